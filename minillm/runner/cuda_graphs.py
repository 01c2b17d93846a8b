"""CUDA graphs for decode-only steps: DecodeGraphs (the model's layers) and MegakernelGraphs (the persistent decode
kernel, minillm/ops/megakernel.py).

A decode step of Qwen3-0.6B is ~340 small kernels; launched eagerly from Python that costs more than the
GPU work at small batch (docs/architecture.md, section 7). We capture one graph per batch-size bucket over
static input buffers and replay it: the step's inputs are copied into the buffers, padded rows write to no
slot (-1) and attend to one token of block 0, and their outputs are ignored.

Graphs are captured with max_seq_len = max_model_len. The decode kernel's split-K grid depends on the batch
size only (every sequence is cut into the same number of partitions), so a replay fits any context.

Capture runs only where the engine's plan (minillm/runner/plan.py) marks every kernel on the decode path
graph-safe. Two guards stay behind that: each warm-up run before a capture runs with host syncs turned into errors
(so a sync is found before any capture starts), and guarded_capture() puts the process back in order if a capture
fails anyway: the stream it ran on, and the CUDA generator, which a failed capture leaves in capture mode ("Offset
increment outside graph capture" for every later engine in the process).
"""
from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager

import torch

from minillm.attention.metadata import AttentionMetadata

log = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 8))
    return sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    def __init__(self, model, kv_caches, max_num_seqs: int, max_blocks: int, block_size: int, max_model_len: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.max_model_len = block_size, max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        z = lambda *shape, dt=torch.int32: torch.zeros(*shape, dtype=dt, device=device)  # noqa: E731
        self.input_ids, self.positions = z(n, dt=torch.int64), z(n, dt=torch.int64)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens, self.block_tables = z(n), z(n, max_blocks)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(num_seqs=bs, num_decodes=bs, num_tokens=bs, max_query_len=1,
                                 max_seq_len=self.max_model_len, slot_mapping=self.slot_mapping[:bs],
                                 query_start_loc=self.query_start_loc[: bs + 1], seq_lens=self.seq_lens[:bs],
                                 block_tables=self.block_tables[:bs], block_size=self.block_size)

    @torch.inference_mode()
    def capture(self) -> None:
        self.seq_lens.fill_(1)
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):       # largest first: smaller graphs reuse its memory pool
            meta = self._meta(bs)
            with no_host_sync():
                self._run(bs, meta)           # warm-up outside capture (lazy inits, autotuning)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self._run(bs, meta)
            self.graphs[bs] = g
        torch.cuda.synchronize()
        log.info("captured %d decode graphs (batch sizes %s)", len(self.graphs), self.sizes)

    def _run(self, bs: int, meta: AttentionMetadata) -> None:
        self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches, meta)

    def bucket(self, n: int) -> int | None:
        for s in self.sizes:
            if s >= n:
                return s
        return None

    def replay(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """Run a decode-only step of meta.num_seqs rows through the smallest graph that holds it."""
        n = meta.num_seqs
        bs = self.bucket(n)
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        if bs > n:   # padded rows: no KV write, one token of context
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].fill_(1)
        self.graphs[bs].replay()
        return self.hidden[:n]


class MegakernelGraphs:
    """DecodeGraphs' interface (bucket(), replay()) over a DecodeMegakernel: one CUDA graph per batch size
    1..max_batch over static input buffers. Padded rows never occur (every size has its graph)."""

    def __init__(self, mk, max_blocks: int):
        self.mk = mk
        n, dev = mk.max_batch, mk.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(num_seqs=b, num_decodes=b, num_tokens=b, max_query_len=1, max_seq_len=1,
                                 slot_mapping=self.slot_mapping[:b], query_start_loc=torch.empty(0),
                                 seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b],
                                 block_size=self.mk.block_size)

    @torch.inference_mode()
    def capture(self, sizes: list[int] | None = None) -> None:
        """Capture with slot -1 and one-token contexts (nothing is written to the caches)."""
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        for b in sizes or range(1, self.mk.max_batch + 1):
            meta = self._meta(b)
            with no_host_sync():
                self.mk.forward(self.input_ids[:b], self.positions[:b], meta)   # warm-up outside capture
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                self.mk.forward(self.input_ids[:b], self.positions[:b], meta)
            self.graphs[b] = g
        torch.cuda.synchronize()

    def bucket(self, n: int) -> int | None:
        return n if n in self.graphs else None

    def replay(self, input_ids, positions, meta) -> torch.Tensor:
        n = meta.num_seqs
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids[:n])
        self.positions[:n].copy_(positions[:n])
        self.slot_mapping[:n].copy_(meta.slot_mapping[:n])
        self.seq_lens[:n].copy_(meta.seq_lens[:n])
        self.block_tables[:n, :width].copy_(meta.block_tables[:n])
        self.graphs[n].replay()
        return self.mk.out[:n]


@contextmanager
def no_host_sync():
    """Host syncs raise inside the block (torch's sync debug mode), as they would fail under capture."""
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def guarded_capture(capture, what: str) -> str | None:
    """Run capture() (which captures CUDA graphs); None when it succeeded, else why it failed, after leaving the
    process usable: the current stream restored, the device synchronised and the CUDA generator out of capture
    mode. The caller then serves that path eagerly."""
    stream = torch.cuda.current_stream()
    try:
        capture()
        return None
    except Exception as e:   # noqa: BLE001 (any failure: the engine must still serve)
        reason = f"capturing the {what} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    torch.cuda.set_stream(stream)
    try:
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        log.error("after the failed capture, synchronize raised: %s", e)
    end_generator_capture()
    return reason


def end_generator_capture() -> None:
    """Take the CUDA generator out of capture mode: a capture that failed never ran its epilogue, and one empty
    capture that succeeds does."""
    g = torch.cuda.CUDAGraph()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "the CUDA graph is empty"
        with torch.cuda.graph(g):
            pass
    del g

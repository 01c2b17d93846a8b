"""Step inputs: SchedulerOutput -> flat token ids, positions, slot mapping and AttentionMetadata.

Host work is numpy on persistent (pinned) buffers, and one H2D copy per step (every field packed in one buffer),
because at 256 running decodes this runs every ~4 ms step and per-request Python or torch work would cost more
than the GPU step itself.
Each live request owns one row of a persistent block table, which only takes the block ids its context grew
into; while a step schedules the same requests as the step before (the common decode step), their rows are
reused as they are. A decode-only step (one token per row) needs no cumsum or repeat: positions are the starts.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from minillm.attention.metadata import AttentionMetadata
from minillm.contract import SchedulerOutput
from minillm.device import to_device
from minillm.runner.request_state import PLACEHOLDER


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class StepInputs:
    input_ids: torch.Tensor       # int64 [T]
    positions: torch.Tensor       # int64 [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [num_sampled]: last row of each seq that samples


@dataclass
class PrevTokens:
    """The previous step's sampled token ids on the device (one per sampled row, in its row order): the step in
    flight, whose tokens the runner does not know on the host yet."""
    token_ids: torch.Tensor
    req_ids: list[str]

    def index_of(self, req_id: str) -> int:
        try:
            return self.req_ids.index(req_id)
        except ValueError:
            raise RuntimeError(f"request {req_id!r} needs an input token that is neither known on the host nor "
                               "sampled by the step in flight") from None


def _fill_placeholders(input_ids: torch.Tensor, host_ids: np.ndarray, req_ids: list[str], num_decodes: int,
                       prev: PrevTokens | None, same_batch: bool) -> None:
    """Replace placeholder (-1) input tokens by the previous step's samples, device to device, no sync.
    same_batch: the decode rows are exactly the rows the step in flight sampled, in its order.

    NOTE: only decode rows can hold one: a request sampled last step has exactly that token left to compute.
    """
    if same_batch:
        input_ids[:num_decodes].copy_(prev.token_ids, non_blocking=True)
        return
    rows = np.flatnonzero(host_ids < 0)
    if rows.size == 0:
        return
    if prev is None or rows[-1] >= num_decodes:
        raise RuntimeError("a placeholder token reached the model outside a decode row after a sampling step")
    index = {rid: i for i, rid in enumerate(prev.req_ids)} if rows.size > 8 else None
    src = [index[req_ids[i]] if index is not None and req_ids[i] in index else prev.index_of(req_ids[i])
           for i in rows.tolist()]
    dev = input_ids.device
    input_ids[to_device(rows, dev)] = prev.token_ids[to_device(np.array(src, dtype=np.int64), dev)]


class BlockTableRows:
    """Persistent [max_num_seqs, max_blocks] block table; one row per live request.

    A decode step usually schedules the very requests of the step before, so the last batch's rows, and how
    many tokens each row's block ids cover, are kept while the batch is unchanged; a row only takes the block
    ids that its context grew into.
    """

    def __init__(self, max_num_seqs: int, max_blocks: int, block_size: int):
        self.block_size = block_size
        self.table = np.zeros((max_num_seqs, max_blocks), dtype=np.int32)
        # How many block ids of each row are valid: a list, since numpy scalar access costs more.
        self.synced = [0] * max_num_seqs
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        # The last rows_for() batch: its requests, their rows, and the tokens each row's block ids cover.
        self._batch: list = []
        self._row_list: list[int] = []
        self._rows = np.zeros(0, dtype=np.int64)
        self._covered = np.zeros(0, dtype=np.int32)            # int32: compared with int32 seq_lens

    def release(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            # Zeroed, so that a later owner's unused entries read 0 as AttentionMetadata promises.
            self.table[row, : self.synced[row]] = 0
            self.synced[row] = 0
            self.free_rows.append(row)
            self._batch = []     # the cached rows may include the freed one

    def rows_for(self, requests) -> np.ndarray:
        """Row of each request, assigned on first sight; int64 [len(requests)]. Do not modify it."""
        # NOTE: list == compares element identity in C (~1 us for 256 rows): far cheaper than 256 lookups.
        if requests != self._batch:
            row_of, free_rows, rows = self.row_of, self.free_rows, []
            for req in requests:
                row = row_of.get(req.request_id)
                if row is None:
                    row = row_of[req.request_id] = free_rows.pop()
                rows.append(row)
            self._batch, self._row_list, self._rows = list(requests), rows, np.array(rows, dtype=np.int64)
            self._covered = np.array([self.synced[r] * self.block_size for r in rows], dtype=np.int32)
        return self._rows

    def sync(self, seq_lens: np.ndarray) -> None:
        """Copy in the block ids that the rows of the last rows_for() batch lack for this step's context
        (seq_lens): a decode needs one more block every block_size steps, so a step of 256 decodes of
        16-token blocks usually extends 16 rows."""
        # NOTE: vectorised on what the step reads, not on len(block_ids), which would visit 256 Python lists.
        # A row that covers its context holds every block the step reads (and, as the KV manager allocates
        # exactly the blocks a context needs, every block id of its request).
        stale = np.flatnonzero(seq_lens > self._covered).tolist()
        if not stale:
            return
        batch, rows, synced, width = self._batch, self._row_list, self.synced, self.table.shape[1]
        # Every new id goes into one scatter through the flat table: numpy calls per row would cost ~1.5 us each.
        flat, new_ids, covered = [], [], []
        for i in stale:
            # NOTE: block lists only grow while a request lives; a preempted request is released first.
            row = rows[i]
            done = synced[row]
            new = batch[i].block_ids[done:]
            flat += range(row * width + done, row * width + done + len(new))
            new_ids += new
            synced[row] = done + len(new)
            covered.append(synced[row] * self.block_size)
        self.table.reshape(-1)[flat] = new_ids
        self._covered[stale] = covered


def _align(n32: int) -> int:
    """Fields start on 64-byte boundaries (16 int32s), as separately allocated tensors would be aligned."""
    return (n32 + 15) & ~15


@functools.lru_cache(maxsize=64)
def _offsets(total: int, n: int) -> tuple[int, ...]:
    """Start of each field in int32 units: input_ids, positions, slot_mapping, logits_indices (int64, so 2
    int32s per element), query_start_loc, seq_lens, block table (int32)."""
    pos = _align(2 * total)
    slots = pos + _align(2 * total)
    logits = slots + _align(2 * total)
    qsl = logits + _align(2 * n)
    seq_lens = qsl + _align(n + 1)
    return 0, pos, slots, logits, qsl, seq_lens, seq_lens + _align(n)


class _Packed:
    """One step's inputs packed in one int64 buffer, so that they cross to the device in one copy (layout:
    _offsets). The host buffer is pinned on CUDA; on the CPU the device buffer is the host one. The device
    views of the last layout are kept: consecutive decode steps lay out the same (T, n, w), and slicing a tensor
    costs ~2 us, seven times a step."""

    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks: int, device: torch.device):
        size32 = _offsets(max_num_tokens, max_num_seqs)[-1] + max_num_seqs * max_blocks
        pin = device.type == "cuda"
        self.host = torch.zeros(cdiv(size32, 2), dtype=torch.int64, pin_memory=pin)
        self.dev = self.host if device.type == "cpu" else torch.zeros_like(self.host, device=device)
        self.np64 = self.host.numpy()
        self.np32 = self.np64.view(np.int32)
        self.dev32 = self.dev.view(torch.int32)
        self._key: tuple | None = None
        self._views: tuple = ()

    def host_views(self, total: int, n: int) -> dict[str, np.ndarray]:
        """The host fields but the block table (whose width is known once seq_lens is)."""
        _, pos, slots, logits, qsl, seq_lens, _ = _offsets(total, n)
        h = self.np64
        return {"input_ids": h[:total], "positions": h[pos // 2:pos // 2 + total],
                "slot_mapping": h[slots // 2:slots // 2 + total], "logits_indices": h[logits // 2:logits // 2 + n],
                "query_start_loc": self.np32[qsl:qsl + n + 1], "seq_lens": self.np32[seq_lens:seq_lens + n]}

    def table_view(self, total: int, n: int, width: int) -> np.ndarray:
        start = _offsets(total, n)[-1]
        return self.np32[start:start + n * width].reshape(n, width)

    def to_device(self, total: int, n: int, width: int, num_sampled: int) -> tuple:
        """(input_ids, positions, slot_mapping, logits_indices, query_start_loc, seq_lens, block_tables) on the
        device, after one copy of the used part of the buffer."""
        _, pos, slots, logits, qsl, seq_lens, table = _offsets(total, n)
        end = cdiv(table + n * width, 2)
        if self.dev is not self.host:
            self.dev[:end].copy_(self.host[:end], non_blocking=True)
        key = (total, n, width, num_sampled)
        if key != self._key:
            d, d32 = self.dev, self.dev32
            self._key, self._views = key, (
                d[:total], d[pos // 2:pos // 2 + total], d[slots // 2:slots // 2 + total],
                d[logits // 2:logits // 2 + num_sampled], d32[qsl:qsl + n + 1], d32[seq_lens:seq_lens + n],
                d32[table:table + n * width].view(n, width))
        return self._views


class InputBuilder:
    def __init__(self, max_num_seqs: int, max_num_tokens: int, max_model_len: int, block_size: int,
                 device: torch.device):
        self.block_size = block_size
        self.max_blocks = cdiv(max_model_len, block_size)
        self.device = device
        self.rows = BlockTableRows(max_num_seqs, self.max_blocks, block_size)
        # NOTE: two packed sets used in turn. With async scheduling, step N+1 is built while step N's
        # non-blocking host-to-device copy may still be queued behind step N-1; it reads the other set.
        self._sets = [_Packed(max_num_tokens, max_num_seqs, self.max_blocks, device) for _ in range(2)]
        self._turn = 0
        self._arange = np.arange(max_num_tokens + 1, dtype=np.int64)   # + 1: query_start_loc has n + 1

    def release(self, req_ids) -> None:
        for rid in req_ids:
            self.rows.release(rid)

    def build(self, so: SchedulerOutput, reqs: list, prev: PrevTokens | None = None) -> StepInputs:
        """Step inputs for `so`, whose rows' request states (minillm/runner/request_state.py) are `reqs`.
        `prev`: the previous step's sampled tokens, still on the device, for the decode rows whose input token
        is a placeholder (async scheduling)."""
        self._turn ^= 1
        packed = self._sets[self._turn]
        n = len(reqs)
        total = n if n == so.num_decodes else sum(so.num_tokens)
        h = packed.host_views(total, n)
        rows = self.rows.rows_for(reqs)
        tok_rows, max_query_len = self._layout(so, rows, h, total)
        qsl, pos, seq_lens, ids = h["query_start_loc"], h["positions"], h["seq_lens"], h["input_ids"]
        self.rows.sync(seq_lens)
        same_batch = self._token_ids(so, reqs, qsl, ids, prev)
        block_idx, offset = np.divmod(pos, self.block_size)
        slots = h["slot_mapping"]
        np.multiply(self.rows.table[tok_rows, block_idx], self.block_size, out=slots, dtype=np.int64)
        slots += offset
        max_seq_len = int(seq_lens.max(initial=0))
        num_sampled = self._logits_indices(so, qsl, h["logits_indices"])
        width = cdiv(max_seq_len, self.block_size)
        packed.table_view(total, n, width)[...] = self.rows.table[rows, :width]
        step = self._to_device(packed, so, total, max_query_len, max_seq_len, width, num_sampled, h)
        if prev is not None or ids.min(initial=0) < 0:
            _fill_placeholders(step.input_ids, ids, so.req_ids, so.num_decodes, prev, same_batch)
        return step

    @staticmethod
    def _logits_indices(so: SchedulerOutput, qsl: np.ndarray, out: np.ndarray) -> int:
        """Each sampled seq's last token; returns how many seqs sample."""
        n = len(so.sample)
        if all(so.sample):
            np.subtract(qsl[1:], 1, out=out)
            return n
        sampled = (qsl[1:] - 1)[np.array(so.sample, dtype=bool)]
        out[:len(sampled)] = sampled
        return len(sampled)

    def _layout(self, so: SchedulerOutput, rows: np.ndarray, h: dict, total: int) -> tuple[np.ndarray, int]:
        """Fill query_start_loc, positions and seq_lens; return (each token's row, max query length)."""
        n = len(rows)
        qsl, pos, seq_lens = h["query_start_loc"], h["positions"], h["seq_lens"]
        if 0 < n == so.num_decodes:
            # One token per row at its start: the common decode step needs no cumsum or repeat.
            pos[:] = so.starts
            qsl[:] = self._arange[: n + 1]
            np.add(pos, 1, out=seq_lens, casting="unsafe")
            return rows, 1
        starts = np.array(so.starts, dtype=np.int64)
        counts = np.array(so.num_tokens, dtype=np.int64)
        qsl[0] = 0
        np.cumsum(counts, out=qsl[1:])
        # position of each token = its seq's start + offset inside the seq's chunk
        np.add(np.repeat(starts - qsl[:-1], counts), self._arange[:total], out=pos)
        np.add(starts, counts, out=seq_lens, casting="unsafe")
        return np.repeat(rows, counts), int(counts.max(initial=0))

    @staticmethod
    def _token_ids(so: SchedulerOutput, reqs: list, qsl: np.ndarray, ids: np.ndarray, prev: PrevTokens | None) -> bool:
        """Row i's tokens are all_token_ids[start:start + num_tokens]; the single-token rows go in one list. A decode
        row one past the tokens known on the host gets a placeholder: its token is the step in flight's sample.
        Returns whether the decode rows are exactly the batch of the step in flight."""
        starts, num_decodes = so.starts, so.num_decodes
        same_batch = prev is not None and num_decodes > 0 and len(prev.req_ids) == num_decodes \
            and so.req_ids[:num_decodes] == prev.req_ids
        if same_batch:
            # NOTE: the common async decode step: the very batch of the step in flight, every input still on the
            # device. No per-row work.
            ids[:num_decodes] = PLACEHOLDER
        else:
            ids[:num_decodes] = [r.all_token_ids[s] if s < len(r.all_token_ids) else PLACEHOLDER
                                 for r, s in zip(reqs[:num_decodes], starts)]
        for i in range(num_decodes, len(reqs)):
            s = starts[i]
            ids[qsl[i]:qsl[i + 1]] = reqs[i].all_token_ids[s:s + so.num_tokens[i]]
        return same_batch

    def _to_device(self, packed: _Packed, so: SchedulerOutput, total: int, max_query_len: int, max_seq_len: int,
                   width: int, num_sampled: int, h: dict) -> StepInputs:
        n = len(so.req_ids)
        ids, pos, slots, logits_indices, qsl, seq_lens, tables = packed.to_device(total, n, width, num_sampled)
        meta = AttentionMetadata(
            num_seqs=n, num_decodes=so.num_decodes, num_tokens=total, max_query_len=max_query_len,
            max_seq_len=max_seq_len, slot_mapping=slots, query_start_loc=qsl, seq_lens=seq_lens,
            block_tables=tables, block_size=self.block_size, query_start_loc_cpu=h["query_start_loc"].tolist(),
            seq_lens_cpu=h["seq_lens"].tolist())
        return StepInputs(input_ids=ids, positions=pos, meta=meta, logits_indices=logits_indices)

"""Step inputs: SchedulerOutput -> flat token ids, positions, slot mapping and AttentionMetadata.

Host work is numpy on persistent (pinned) buffers, one H2D copy per field, because at 256 running decodes
this runs every ~4 ms step and per-request torch ops would cost more than the GPU step itself.
Each live request owns one row of a persistent block table; new block ids are appended to that row as
the KV manager grows request.block_ids, so a decode step copies no block ids at all on the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minillm.attention.metadata import AttentionMetadata
from minillm.device import to_device
from minillm.engine.outputs import SchedulerOutput


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class StepInputs:
    input_ids: torch.Tensor       # int64 [T]
    positions: torch.Tensor       # int64 [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [num_sampled]: last row of each seq that samples
    sample_seq_idx: list[int]     # index into scheduled of each sampled row


@dataclass
class PrevTokens:
    """The previous step's sampled token ids on the device, and each sampled request's index into them."""
    token_ids: torch.Tensor
    index: dict[str, int]


def _fill_placeholders(input_ids: torch.Tensor, host_ids: np.ndarray, seqs, num_decodes: int,
                       prev: PrevTokens | None) -> None:
    """Replace placeholder (-1) input tokens by the previous step's samples, device to device, no sync.

    NOTE: only decode rows can hold one: a request sampled last step has exactly that token left to compute.
    """
    rows = np.flatnonzero(host_ids < 0)
    if rows.size == 0:
        return
    if prev is None or rows[-1] >= num_decodes:
        raise RuntimeError("a placeholder token reached the model outside a decode row after a sampling step")
    src = [prev.index[seqs[i].request.request_id] for i in rows.tolist()]
    dev = input_ids.device
    input_ids[to_device(rows, dev)] = prev.token_ids[to_device(np.array(src, dtype=np.int64), dev)]


class BlockTableRows:
    """Persistent [max_num_seqs, max_blocks] block table; one row per live request."""

    def __init__(self, max_num_seqs: int, max_blocks: int):
        self.table = np.zeros((max_num_seqs, max_blocks), dtype=np.int32)
        # How many block ids of each row are valid: a Python list, since numpy scalar access costs more
        # than the check itself, 256 times a step.
        self.synced = [0] * max_num_seqs
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))

    def release(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.synced[row] = 0
            self.free_rows.append(row)

    def sync_all(self, seqs) -> tuple[list[int], list[int], list[int]]:
        """Rows of the scheduled requests (assigned on first sight), with any block ids appended since the
        last step copied in; also returns the seqs' starts and token counts (one pass over the batch)."""
        row_of, synced, table = self.row_of, self.synced, self.table
        rows, starts, counts = [], [], []
        for s in seqs:
            req = s.request
            row = row_of.get(req.request_id)
            if row is None:
                row = self.free_rows.pop()
                row_of[req.request_id] = row
            bids = req.block_ids
            n, done = len(bids), synced[row]
            if n != done:
                # NOTE: block lists only grow while a request lives; a preempted request is released first.
                table[row, done:n] = bids[done:n]
                synced[row] = n
            rows.append(row)
            starts.append(s.start)
            counts.append(s.num_tokens)
        return rows, starts, counts


class InputBuilder:
    def __init__(self, max_num_seqs: int, max_num_tokens: int, max_model_len: int, block_size: int,
                 device: torch.device):
        self.block_size = block_size
        self.max_blocks = cdiv(max_model_len, block_size)
        self.device = device
        self.rows = BlockTableRows(max_num_seqs, self.max_blocks)
        pin = device.type == "cuda"

        def staging() -> dict[str, torch.Tensor]:
            return {
                "input_ids": torch.zeros(max_num_tokens, dtype=torch.int64, pin_memory=pin),
                "positions": torch.zeros(max_num_tokens, dtype=torch.int64, pin_memory=pin),
                "slot_mapping": torch.zeros(max_num_tokens, dtype=torch.int64, pin_memory=pin),
                "query_start_loc": torch.zeros(max_num_seqs + 1, dtype=torch.int32, pin_memory=pin),
                "seq_lens": torch.zeros(max_num_seqs, dtype=torch.int32, pin_memory=pin),
                "logits_indices": torch.zeros(max_num_seqs, dtype=torch.int64, pin_memory=pin),
            }
        # NOTE: two staging sets used in turn. With async scheduling, step N+1 is built while step N's
        # non-blocking host-to-device copies may still be queued behind step N-1; they read the other set.
        self._sets = [staging(), staging()]
        self._sets_np = [{k: v.numpy() for k, v in st.items()} for st in self._sets]
        self._turn = 0
        self._arange = np.arange(max_num_tokens, dtype=np.int64)

    def release(self, req_ids) -> None:
        for rid in req_ids:
            self.rows.release(rid)

    def build(self, so: SchedulerOutput, prev: PrevTokens | None = None) -> StepInputs:
        """Step inputs for `so`. `prev`: the previous step's sampled tokens, still on the device, for the
        decode rows whose input token is a placeholder (async scheduling)."""
        self._turn ^= 1
        self._host, self._np = self._sets[self._turn], self._sets_np[self._turn]
        self.release(so.preempted_ids)
        seqs = so.scheduled
        n = len(seqs)
        rows, starts, counts = self.rows.sync_all(seqs)
        rows = np.array(rows, dtype=np.int64)
        starts = np.array(starts, dtype=np.int64)
        counts = np.array(counts, dtype=np.int64)
        total = int(counts.sum())

        h = self._np
        qsl = h["query_start_loc"][: n + 1]
        qsl[0] = 0
        np.cumsum(counts, out=qsl[1:])
        ids = h["input_ids"][:total]
        num_decodes = so.num_decodes
        ids[:num_decodes] = [s.request.all_token_ids[s.start] for s in seqs[:num_decodes]]
        for i in range(num_decodes, n):
            s = seqs[i]
            ids[qsl[i]:qsl[i + 1]] = s.request.all_token_ids[s.start:s.start + s.num_tokens]

        # position of each token = its seq's start + offset inside the seq's chunk
        pos = h["positions"][:total]
        np.add(np.repeat(starts - qsl[:-1], counts), self._arange[:total], out=pos)
        tok_rows = np.repeat(rows, counts)
        bs = self.block_size
        h["slot_mapping"][:total] = self.rows.table[tok_rows, pos // bs].astype(np.int64) * bs + pos % bs
        seq_lens = h["seq_lens"][:n]
        np.add(starts, counts, out=seq_lens, casting="unsafe")
        max_seq_len = int(seq_lens.max()) if n else 0
        sample_idx = [i for i, s in enumerate(seqs) if s.sample]
        h["logits_indices"][: len(sample_idx)] = qsl[1:][sample_idx] - 1
        block_tables = self.rows.table[rows, : cdiv(max_seq_len, bs)]
        step = self._to_device(so, n, total, num_decodes, int(counts.max()) if n else 0, max_seq_len,
                               block_tables, sample_idx)
        if prev is not None or (ids < 0).any():
            _fill_placeholders(step.input_ids, ids, seqs, num_decodes, prev)
        return step

    def _to_device(self, so, n, total, num_decodes, max_query_len, max_seq_len, block_tables, sample_idx):
        dev, host = self.device, self._host

        def put(name: str, length: int) -> torch.Tensor:
            return host[name][:length].to(dev, non_blocking=True)

        meta = AttentionMetadata(
            num_seqs=n, num_decodes=num_decodes, num_tokens=total, max_query_len=max_query_len,
            max_seq_len=max_seq_len, slot_mapping=put("slot_mapping", total),
            query_start_loc=put("query_start_loc", n + 1), seq_lens=put("seq_lens", n),
            block_tables=to_device(block_tables, dev), block_size=self.block_size,
            query_start_loc_cpu=self._np["query_start_loc"][: n + 1].tolist(),
            seq_lens_cpu=self._np["seq_lens"][:n].tolist())
        return StepInputs(input_ids=put("input_ids", total), positions=put("positions", total), meta=meta,
                          logits_indices=put("logits_indices", len(sample_idx)), sample_seq_idx=sample_idx)

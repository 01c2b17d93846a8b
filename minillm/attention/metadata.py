"""Attention metadata: built once per step by the runner and passed explicitly to every layer.

Flat token layout. The step's tokens are concatenated request by request in SchedulerOutput order, so
rows [0, num_decodes) each hold exactly one query token (decode rows) and the rest are prefill chunks.

KV cache layout (per layer): k_cache, v_cache of shape [num_blocks, block_size, num_kv_heads, head_dim].
Token t of a sequence lives in block block_tables[s, t // block_size] at offset t % block_size, i.e. in
flat slot  block_id * block_size + offset  of k_cache.view(-1, num_kv_heads, head_dim).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    num_seqs: int
    num_decodes: int            # seqs [0, num_decodes) have query_len == 1
    num_tokens: int             # real tokens this step (rows past it, if any, are CUDA-graph padding)
    max_query_len: int
    max_seq_len: int
    slot_mapping: torch.Tensor      # int64 [num_tokens(+pad)]: cache slot of each new token; -1 = skip
    query_start_loc: torch.Tensor   # int32 [num_seqs + 1]: row offsets of each seq's queries
    seq_lens: torch.Tensor          # int32 [num_seqs]: context length after this step (cached + new)
    block_tables: torch.Tensor      # int32 [num_seqs, max_blocks]: physical block ids; unused entries = 0
    block_size: int
    # Host copies (the torch path loops over sequences on the host).
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None

    @property
    def num_prefills(self) -> int:
        return self.num_seqs - self.num_decodes

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

    def host_lists(self) -> tuple[list[int], list[int]]:
        """Host copies of query_start_loc and seq_lens; one device->host copy each if the runner did not provide
        them (the runner always does)."""
        qsl = self.query_start_loc_cpu if self.query_start_loc_cpu is not None else self.query_start_loc.tolist()
        lens = self.seq_lens_cpu if self.seq_lens_cpu is not None else self.seq_lens.tolist()
        return qsl, lens

"""Diagnostics above the model: the cases behind `minillm check-kernels` (kernel_check.py: the attention kernels;
megakernel_check.py: the persistent decode kernel against the model's torch path; moe_check.py: the fused MoE
kernels against their torch twins) and the helpers that turn the ops' plain-torch test batches into engine
metadata. minillm/ops/ only wraps kernels and imports none of this."""
from __future__ import annotations

from minillm.attention.metadata import AttentionMetadata


def paged_meta(batch, num_decodes: int = 0) -> AttentionMetadata:
    """The AttentionMetadata of a PagedBatch (minillm/ops/reference.py: make_paged_batch), its first num_decodes
    sequences being decode rows."""
    qsl = batch.query_start_list
    q_lens = [b - a for a, b in zip(qsl, qsl[1:])]
    return AttentionMetadata(
        num_seqs=len(batch.seq_lens_list), num_decodes=num_decodes, num_tokens=batch.q.shape[0],
        max_query_len=max(q_lens), max_seq_len=max(batch.seq_lens_list), slot_mapping=batch.slot_mapping,
        query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens, block_tables=batch.block_tables,
        block_size=batch.block_size, query_start_loc_cpu=list(qsl), seq_lens_cpu=list(batch.seq_lens_list))

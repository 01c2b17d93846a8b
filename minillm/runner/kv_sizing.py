"""How many KV blocks the pool gets, and the pool itself.

On a GPU the pool takes what is left of gpu_memory_utilization * total memory after the peak of the
largest possible step (measured by running it once on a scratch cache). On the CPU it is sized to hold
max_num_seqs full-length sequences, capped at about the model's own size (at least CPU_KV_MIN_BYTES, at most
CPU_KV_MAX_BYTES) and at half the free memory, and never below one full-length sequence: CPU serving runs few
sequences at once, and a preempted one is recomputed. Before any of it is allocated, the step buffers and an
explicit cache.num_kv_blocks are checked against the free memory (minillm/limits.py).
"""
from __future__ import annotations

import logging

import torch

from minillm.attention.metadata import AttentionMetadata
from minillm.config import CacheConfig, ConfigError
from minillm.limits import (HOST_BYTES_PER_BLOCK, EngineShape, check_kv_fits, check_step_fits, device_free_bytes,
                            usable)

log = logging.getLogger(__name__)
CPU_KV_MIN_BYTES = 256 << 20
CPU_KV_MAX_BYTES = 2 << 30


def engine_shape(runner) -> EngineShape:
    a, sched = runner.arch, runner.cfg.scheduler
    return EngineShape(max_num_seqs=sched.max_num_seqs, max_num_tokens=runner.max_num_tokens,
                       max_model_len=runner.max_model_len, block_size=runner.cfg.cache.block_size,
                       hidden_size=a.hidden_size, intermediate_size=a.intermediate_size, q_size=a.q_size,
                       kv_size=a.kv_size, vocab_size=a.vocab_size, dtype_bytes=_element_size(runner.dtype))


def _element_size(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def choose_num_blocks(runner, cache: CacheConfig) -> int:
    """The pool size, after checking that the step buffers and the pool fit in the device's free memory."""
    per_block = runner.kv_bytes_per_block()
    needed_per_seq = runner.blocks_for(runner.max_model_len)
    on_gpu = runner.device.type == "cuda"
    where = "the GPU" if on_gpu else "this machine"
    shape = engine_shape(runner)
    free = device_free_bytes(runner.device)
    check_step_fits(shape, free, where)
    left = None if free is None else free - shape.step_bytes
    # On the CPU the pool's bookkeeping shares the memory with its tensor.
    block_cost = per_block if on_gpu else per_block + HOST_BYTES_PER_BLOCK
    if cache.num_kv_blocks is not None:
        num = cache.num_kv_blocks
        check_kv_fits(num, block_cost, left, where, f"cache.num_kv_blocks={num:,}")
    elif on_gpu:
        num = _gpu_blocks(runner, cache, per_block)
    else:
        num = _cpu_blocks(runner, per_block, needed_per_seq, left)
        check_kv_fits(num, block_cost, left, where,
                      f"one sequence of max_model_len={runner.max_model_len} (lower model.max_model_len)")
    if num < needed_per_seq:
        raise ConfigError(
            f"the KV cache holds {num} blocks x {cache.block_size} tokens = {num * cache.block_size} tokens, less "
            f"than one sequence of max_model_len={runner.max_model_len}: lower model.max_model_len or raise "
            f"cache.gpu_memory_utilization / cache.num_kv_blocks")
    return num


def _cpu_blocks(runner, per_block: int, needed_per_seq: int, left: int | None) -> int:
    """The CPU default: max_num_seqs full-length sequences, within the caps of the module docstring."""
    want = runner.cfg.scheduler.max_num_seqs * needed_per_seq
    weights = runner.arch.num_params * _element_size(runner.dtype)
    cap = min(CPU_KV_MAX_BYTES, max(CPU_KV_MIN_BYTES, weights))
    room = usable(left)
    if room is not None:
        cap = min(cap, room // 2)
    return max(min(want, cap // per_block), needed_per_seq)


def _gpu_blocks(runner, cache: CacheConfig, per_block: int) -> int:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    peak = profile_run(runner)
    free, total = torch.cuda.mem_get_info()
    non_torch = (total - free) - torch.cuda.memory_reserved()
    budget = cache.gpu_memory_utilization * total - peak - max(non_torch, 0)
    num = int(budget // per_block)
    log.info("KV pool: %d blocks (%.1f GiB); step peak %.2f GiB", num, num * per_block / 2**30, peak / 2**30)
    if num <= 0:
        raise ConfigError(f"cache.gpu_memory_utilization={cache.gpu_memory_utilization} leaves no memory for the "
                          f"KV cache (model + largest step take {peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB)")
    return num


def prefill_batch(runner, total: int, write: bool = True, seq_len: int | None = None):
    """A prefill step of `total` tokens split into sequences of seq_len (default and at most max_model_len):
    (input_ids, positions, metadata, blocks it uses). write=True: the sequences own blocks 1.. and their K/V are
    written there; write=False: every table entry is block 0 and nothing is written (slot -1), so the step leaves
    the cache as it was."""
    bs, dev = runner.cfg.cache.block_size, runner.device
    step = min(seq_len or runner.max_model_len, runner.max_model_len)
    lens = [min(step, total - i) for i in range(0, total, step)]
    blocks_per = [runner.blocks_for(n) for n in lens]
    tables = torch.zeros(len(lens), max(blocks_per), dtype=torch.int32)
    first = 1
    for i, nb in enumerate(blocks_per):
        if write:
            tables[i, :nb] = torch.arange(first, first + nb)
        first += nb
    positions = torch.cat([torch.arange(n) for n in lens])
    slots = torch.cat([tables[i, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
                       for i, n in enumerate(lens)])
    if not write:
        slots.fill_(-1)
    qsl = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
    meta = AttentionMetadata(num_seqs=len(lens), num_decodes=0, num_tokens=total, max_query_len=max(lens),
                             max_seq_len=max(lens), slot_mapping=slots.to(dev), query_start_loc=qsl.to(dev),
                             seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
                             block_tables=tables.to(dev), block_size=bs, query_start_loc_cpu=qsl.tolist(),
                             seq_lens_cpu=list(lens))
    ids = torch.randint(0, runner.arch.vocab_size, (total,), device=dev)
    return ids, positions.to(dev), meta, first


@torch.inference_mode()
def profile_run(runner) -> int:
    """Run the largest step once (a prefill of the most tokens a step can hold, split into max_model_len pieces,
    then max_num_seqs rows of logits plus sampler-sized scratch) on a scratch KV cache; return peak bytes."""
    total = runner.max_num_tokens
    ids, positions, meta, blocks = prefill_batch(runner, total)
    scratch = runner.kv_spec.allocate(blocks, runner.device)
    dev = runner.device
    hidden = runner.model(ids, positions, scratch, meta)
    rows = torch.arange(runner.cfg.scheduler.max_num_seqs, device=dev) % total
    logits = runner.model.compute_logits(hidden[rows], keep_dtype=True)   # as the runner asks for them
    # The sampler's torch path: softmax + noise buffers, plus its float32 copy of half-precision logits.
    n_scratch = 2 if logits.dtype == torch.float32 else 3
    scratch_sampler = [torch.empty(logits.shape, dtype=torch.float32, device=dev) for _ in range(n_scratch)]
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del hidden, logits, scratch, scratch_sampler
    torch.cuda.empty_cache()
    return peak

"""`check-kernels` cases for fp8 KV caches (needs a GPU): every kernel that accepts an fp8 cache against the fp32
reference of the dequantized cache, on NaN-poisoned caches with random block tables and per-KV-head scales.

Cases: kv_write_fp8 against the reference's quantize and the fused qk_norm_rope KV write against the unfused
kernels (whole caches bit for bit, untouched NaN slots unchanged, values past the fp8 range saturated), paged decode
v1 / split-K / equal partitions and paged prefill (ragged, prefix hits, chunks), each against paged_attention_ref
over the dequantized cache. Rows have the shape of minillm/diagnostics/kernel_check.py's (case, max_abs_err, tol, passed);
run_fp8_timings adds the decode kernel's bandwidth in fp8 bytes.
"""
from __future__ import annotations

import torch

from minillm.ops.kv_quant import FP8_DTYPES, dequantize, quantize
from minillm.ops.reference import PagedBatch, make_paged_batch, paged_attention_ref

TOL = {"bfloat16": 2e-2, "float16": 4e-3}
_ACT = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def fp8_batch(ctx, ql, hq, hkv, d, bs, act: torch.dtype, cache: torch.dtype, device="cuda", seed=0):
    """make_paged_batch with its earlier tokens quantized into fp8 caches (NaN stays NaN: the poison survives)
    and random per-head scales; k/v get a few values far past the fp8 range, so the write must saturate.
    -> (batch with fp8 caches, k_scale, v_scale)."""
    b = make_paged_batch(ctx, ql, hq, hkv, d, bs, act, device, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    ks = (0.005 + 0.02 * torch.rand(hkv, generator=gen)).to(device)
    vs = (0.005 + 0.02 * torch.rand(hkv, generator=gen)).to(device)
    b.k[0, 0, :4] = torch.tensor([1e4, -1e4, 3e4, -65000.0], dtype=act)
    kc, vc = quantize(b.k_cache, ks, cache), quantize(b.v_cache, vs, cache)
    fb = PagedBatch(**{**b.__dict__, "k_cache": kc, "v_cache": vc})
    return fb, ks, vs


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _case_kv_write(d, hkv, bs, act, cache, seed) -> float:
    from minillm.ops import attention_ops as ops
    from minillm.ops.reference import kv_write_ref

    b, ks, vs = fp8_batch([21, 40, 3], [21, 9, 1], 2 * hkv, hkv, d, bs, act, cache, seed=seed)
    slots = b.slot_mapping.clone()
    slots[1::3] = -1
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    ops.kv_write(b.k, b.v, kc, vc, slots, ks, vs)
    kv_write_ref(b.k, b.v, b.k_cache, b.v_cache, slots, ks, vs)
    same = torch.equal(_bits(kc), _bits(b.k_cache)) and torch.equal(_bits(vc), _bits(b.v_cache))
    return 0.0 if same else float("inf")


def _case_rope_cache(d, hkv, bs, act, cache, seed) -> float:
    """The fused write against the unfused kernels (qk_norm_rope, then kv_write_fp8) on the same inputs: the same
    q and the same cache bits (kv_write_fp8 itself is checked against the reference above)."""
    from minillm.ops import attention_ops as ops
    from minillm.ops.fused_ops import qk_norm_rope, rope_cos_sin_cache

    hq, t = 2 * hkv, 37
    b, ks, vs = fp8_batch([t + 5], [t], hq, hkv, d, bs, act, cache, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=gen) * 3).to(act).cuda()
    qkv[0, hq * d] = 30000.0                                     # a k value that must saturate
    pos = torch.arange(5, 5 + t, device="cuda")
    cs = rope_cos_sin_cache(d, 128, 1e6, device="cuda")
    wq = (1 + 0.1 * torch.randn(d, generator=gen)).to(act).cuda()
    wk = (1 + 0.1 * torch.randn(d, generator=gen)).to(act).cuda()
    slots = b.slot_mapping.clone()
    slots[2] = -1
    fused, unfused = (b.k_cache.clone(), b.v_cache.clone()), (b.k_cache.clone(), b.v_cache.clone())
    q, _, _ = qk_norm_rope(qkv, pos, cs, hq, hkv, d, wq, wk, 1e-6, kv_cache_out=(*fused, slots, ks, vs), cuda=True)
    q_ref, k, v = qk_norm_rope(qkv, pos, cs, hq, hkv, d, wq, wk, 1e-6, cuda=True)
    ops.kv_write(k, v, *unfused, slots, ks, vs)
    same = all(torch.equal(_bits(a), _bits(r)) for a, r in zip(fused, unfused)) and torch.equal(q, q_ref)
    return 0.0 if same else float("inf")


def _decode_batches():
    yield "small", [1, 16, 17, 33, 100], None
    yield "long_v1", [3000, 4100], 0
    yield "long_split256", [3000, 4100, 5], 256
    yield "ragged_equal5", [3000, 1, 33, 4100, 300], -5


def _case_decode(d, hq, hkv, bs, act, cache, ctx, part, seed) -> float:
    from minillm.ops import attention_ops as ops
    from minillm.ops.reference import kv_write_ref

    b, ks, vs = fp8_batch(ctx, [1] * len(ctx), hq, hkv, d, bs, act, cache, seed=seed)
    kv_write_ref(b.k, b.v, b.k_cache, b.v_cache, b.slot_mapping, ks, vs)
    ref = paged_attention_ref(b.q, dequantize(b.k_cache, ks), dequantize(b.v_cache, vs), b.block_tables,
                              b.seq_lens_list, b.query_start_list, d ** -0.5)
    out = torch.full_like(b.q, float("nan"))
    ops.paged_decode(out, b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, d ** -0.5, max(ctx), part,
                     k_scale=ks, v_scale=vs)
    diff = (out.float() - ref).abs()
    return float("nan") if torch.isnan(diff).any() else float(diff.max())


def _prefill_batches():
    yield "ragged", [1, 15, 16, 17, 63, 64, 65, 129], [1, 15, 16, 17, 63, 64, 65, 129]
    yield "prefix_hit", [80, 300, 33], [16, 45, 1]
    yield "chunked", [512, 700], [256, 188]


def _case_prefill(d, hq, hkv, bs, act, cache, ctx, ql, seed) -> float:
    from minillm.ops import attention_ops as ops
    from minillm.ops.reference import kv_write_ref

    b, ks, vs = fp8_batch(ctx, ql, hq, hkv, d, bs, act, cache, seed=seed)
    kv_write_ref(b.k, b.v, b.k_cache, b.v_cache, b.slot_mapping, ks, vs)
    ref = paged_attention_ref(b.q, dequantize(b.k_cache, ks), dequantize(b.v_cache, vs), b.block_tables,
                              b.seq_lens_list, b.query_start_list, d ** -0.5)
    out = torch.full_like(b.q, float("nan"))
    ops.paged_prefill(out, b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, d ** -0.5,
                      max(ql), k_scale=ks, v_scale=vs)
    diff = (out.float() - ref).abs()
    return float("nan") if torch.isnan(diff).any() else float(diff.max())


def run_fp8_cases(quick: bool = False) -> list[dict]:
    """One row per case: {case, max_abs_err, tol, passed}."""
    rows = []
    shapes = [(128, 16, 8, 16), (64, 8, 2, 32)] if quick else [(128, 16, 8, 16), (128, 16, 8, 32), (64, 8, 2, 32),
                                                              (64, 12, 4, 16), (128, 32, 2, 16), (128, 8, 1, 32)]
    for name, cache in (("fp8", FP8_DTYPES["fp8"]), ("fp8_e5m2", FP8_DTYPES["fp8_e5m2"])):
        for dt in ("bfloat16", "float16"):
            act = _ACT[dt]
            for d, hq, hkv, bs in shapes:
                tag = f"{name} {dt} D{d} H{hq}/{hkv} bs{bs}"
                for case, err in ((f"kv_write {tag}", _case_kv_write(d, hkv, bs, act, cache, 1)),
                                  (f"rope_cache {tag}", _case_rope_cache(d, hkv, bs, act, cache, 2))):
                    rows.append(dict(case=case, max_abs_err=err, tol=0.0, passed=err == 0.0))
                for label, ctx, part in _decode_batches():
                    err = _case_decode(d, hq, hkv, bs, act, cache, ctx, part, 3)
                    rows.append(dict(case=f"decode {label} {tag}", max_abs_err=err, tol=TOL[dt],
                                     passed=err <= TOL[dt]))
                for label, ctx, ql in _prefill_batches():
                    err = _case_prefill(d, hq, hkv, bs, act, cache, ctx, ql, 4)
                    rows.append(dict(case=f"prefill {label} {tag}", max_abs_err=err, tol=TOL[dt],
                                     passed=err <= TOL[dt]))
    return rows


def run_fp8_timings(batch: int = 256, ctx: int = 1024, hq=16, hkv=8, d=128, bs=16,
                    caches: tuple[str, ...] = ("bfloat16", "fp8")) -> list[dict]:
    """Decode over each cache ("bfloat16" or an FP8_DTYPES name) in its own bytes (CUDA-graph replays, the
    dispatcher's partitioning): ms and us per call, the bytes it reads (K and V of every context token in the
    cache's element size) and TB/s of those bytes."""
    from minillm.ops import attention_ops as ops
    from minillm.diagnostics.kernel_check import _rotations, _time_graph

    dev, scale, nb = "cuda", d ** -0.5, ctx // bs
    rows = []
    for name in caches:
        cache = torch.bfloat16 if name == "bfloat16" else FP8_DTYPES[name]
        esize = torch.empty(0, dtype=cache).element_size()
        kv_bytes = batch * ctx * hkv * d * 2 * esize
        rot = _rotations(kv_bytes)
        kc = torch.randn(rot * batch * nb, bs, hkv, d, device=dev).to(cache)
        vc = torch.randn_like(kc, dtype=torch.float32).to(cache)
        bt = torch.randperm(rot * batch * nb, device=dev).to(torch.int32).view(rot, batch, nb)
        q = torch.randn(rot, batch, hq, d, device=dev, dtype=torch.bfloat16)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        out = torch.empty(batch, hq, d, device=dev, dtype=torch.bfloat16)
        sc = None if name == "bfloat16" else torch.ones(hkv, device=dev)
        fns = [lambda i=i: ops.paged_decode(out, q[i], kc, vc, bt[i], lens, scale, ctx, k_scale=sc, v_scale=sc)
               for i in range(rot)]
        ms = _time_graph(fns)
        part = ops.decode_partition_size(batch, hkv, ctx, torch.cuda.get_device_properties(0).multi_processor_count)
        rows.append(dict(bench=f"decode B={batch} ctx={ctx} H{hq}/{hkv} D{d} bs{bs}", impl=f"minillm {name} cache",
                         ms=ms, us=ms * 1e3, kv_bytes=kv_bytes, tb_s=kv_bytes / ms / 1e9, partition_size=part))
        del kc, vc, fns
        torch.cuda.empty_cache()
    return rows

"""Long prefill chunks on flash attention: whole prompts on torch SDPA (the plan's prefill_sdpa verdict,
kernels.prefill_sdpa / prefill_sdpa_min_tokens) and chunks over a cached prefix on the varlen flash op
(prefill_flash_varlen, kernels.prefill_sdpa_prefix): what the plan records and why, the config checks, the ragged
K/V gather, and which rows of a step the CUDA backend sends where. The backend tests run on the CPU with the paged
kernels and the varlen op replaced by their references (varlen_ref: the op's semantics, bottom-right causal);
tests/test_prefill_sdpa_gpu.py runs the real ones."""
import dataclasses
import re

import pytest
import torch

from minillm.attention.cuda_backend import CudaAttentionBackend, PrefillRoute, split_prefill
from minillm.cache.spec import KVCacheSpec
from minillm.config import ConfigError, EngineConfig
from minillm.config_loader import load_config
from minillm.diagnostics import paged_meta
from minillm.model.loader import resolve_arch
from minillm.ops import attention_ops as ops
from minillm.ops.reference import (attend, gather_kv, gather_kv_ragged, kv_write_ref, make_paged_batch,
                                   paged_attention_ref, paged_decode_ref, ragged_kv_slots)
from test_plan import A100, CPU, plan


@pytest.fixture(autouse=True)
def extension_loads(monkeypatch):
    from minillm.ops import build

    monkeypatch.setattr(build, "load_extension", lambda: object())   # as tests/test_plan.py: nothing is built


# ---- the plan and the config

def test_the_plan_records_the_route_and_its_threshold():
    p = plan()
    assert p.prefill_sdpa.on and p.prefill_sdpa_min_tokens == EngineConfig().kernels.prefill_sdpa_min_tokens
    rec = p.record()["plan"]["prefill_sdpa"]
    assert rec == {"on": True, "reason": p.prefill_sdpa.reason, "min_tokens": p.prefill_sdpa_min_tokens}
    assert "whole prompts" in rec["reason"] and "prefill_sdpa=on" in p.describe()
    q = plan(prefill_sdpa_min_tokens=300)
    assert q.prefill_sdpa_min_tokens == 300 and ">= 300 tokens" in q.prefill_sdpa.reason
    assert plan(device=A100).prefill_sdpa.on    # flash runs on sm_80


def test_the_plan_records_chunks_over_a_prefix_on_the_varlen_op():
    p = plan()
    assert p.prefill_flash_varlen.on and p.prefill_prefix_min_tokens == p.prefill_sdpa_min_tokens
    rec = p.record()["plan"]["prefill_flash_varlen"]
    assert rec == {"on": True, "reason": p.prefill_flash_varlen.reason, "min_tokens": p.prefill_sdpa_min_tokens}
    assert "over a cached prefix" in rec["reason"] and "prefill_flash_varlen=on" in p.describe()
    assert "varlen flash op" in p.prefill_sdpa.reason
    assert plan(prefill_sdpa_min_tokens=300).prefill_prefix_min_tokens == 300
    assert plan(device=A100).prefill_flash_varlen.on


@pytest.mark.parametrize("kw,why", [
    (dict(prefill_sdpa_prefix=False), "kernels.prefill_sdpa_prefix=false"),
    (dict(prefill_sdpa=False), "whole prompts on SDPA, which is off (kernels.prefill_sdpa=false)"),
    (dict(kv_cache_dtype="fp8"), "quantized"),
    (dict(attention_mode="unified"), "unified"),
    (dict(kernels="torch"), "prefill kernel, which is off"),
])
def test_the_prefix_route_is_off_where_it_does_not_apply_and_says_why(kw, why):
    p = plan(**kw)
    assert not p.prefill_flash_varlen.on and why in p.prefill_flash_varlen.reason
    assert p.prefill_prefix_min_tokens == 0 and p.record()["plan"]["prefill_flash_varlen"]["on"] is False
    if kw == dict(prefill_sdpa_prefix=False):   # whole prompts keep SDPA; its reason says where chunks go
        assert p.prefill_sdpa.on and "chunks over a prefix on the prefill kernel" in p.prefill_sdpa.reason


def test_without_the_op_in_torch_chunks_over_a_prefix_stay_on_the_kernel(monkeypatch):
    monkeypatch.setattr(ops, "flash_varlen_available", lambda: False)
    p = plan()
    assert p.prefill_sdpa.on and not p.prefill_flash_varlen.on
    assert "no aten::_flash_attention_forward" in p.prefill_flash_varlen.reason


def test_the_op_is_in_this_torch_and_takes_the_varlen_arguments():
    assert ops.flash_varlen_available()
    args = [a.name for a in torch.ops.aten._flash_attention_forward.default._schema.arguments]
    assert args[:10] == ["query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
                         "is_causal", "return_debug_mask"] and "scale" in args


@pytest.mark.parametrize("kw,why", [
    (dict(prefill_sdpa=False), "kernels.prefill_sdpa=false"),
    (dict(kv_cache_dtype="fp8"), "quantized"),
    (dict(kv_cache_dtype="fp8_e5m2"), "quantized"),
    (dict(attention_mode="unified"), "unified"),
    (dict(attention="torch"), "prefill kernel, which is off"),
    (dict(kernels="torch"), "prefill kernel, which is off"),
    (dict(device=CPU, dtype="float32"), "prefill kernel, which is off"),
])
def test_the_route_is_off_where_it_does_not_apply_and_says_why(kw, why):
    p = plan(**kw)
    assert not p.prefill_sdpa.on and why in p.prefill_sdpa.reason and p.prefill_sdpa_min_tokens == 0
    assert p.record()["plan"]["prefill_sdpa"]["on"] is False


@pytest.mark.parametrize("bad", [0, -1, 1 << 25])
def test_a_bad_threshold_is_a_config_error_naming_the_key(bad):
    with pytest.raises(ConfigError, match=re.escape(f"kernels.prefill_sdpa_min_tokens={bad} is not allowed")):
        EngineConfig.from_kwargs(prefill_sdpa_min_tokens=bad)
    with pytest.raises(ConfigError, match=re.escape("kernels.prefill_sdpa_min_tokens")):
        load_config(None, [f"kernels.prefill_sdpa_min_tokens={bad}"])
    with pytest.raises(ConfigError, match=re.escape("kernels.prefill_sdpa=")):
        load_config(None, ["kernels.prefill_sdpa=7"])


def test_the_prefix_switch_is_a_checked_bool():
    with pytest.raises(ConfigError, match=re.escape("kernels.prefill_sdpa_prefix=")):
        EngineConfig.from_kwargs(prefill_sdpa_prefix="yes")
    with pytest.raises(ConfigError, match=re.escape("kernels.prefill_sdpa_prefix=")):
        load_config(None, ["kernels.prefill_sdpa_prefix=7"])
    assert not load_config(None, ["kernels.prefill_sdpa_prefix=false"])[0].kernels.prefill_sdpa_prefix
    assert EngineConfig().kernels.prefill_sdpa_prefix


def test_an_fp8_cache_is_refused_by_a_backend_with_the_route():
    arch = resolve_arch("qwen3-0.6b")
    spec = KVCacheSpec.for_model(arch, 16, "fp8", torch.bfloat16)
    CudaAttentionBackend().bind_kv_cache(spec)   # no threshold: the narrow kernel reads it
    with pytest.raises(ValueError, match="not fp8"):
        CudaAttentionBackend(prefill_sdpa_min_tokens=16).bind_kv_cache(spec)
    with pytest.raises(ValueError, match="not fp8"):
        CudaAttentionBackend(prefill_prefix_min_tokens=16).bind_kv_cache(spec)


# ---- which rows go where

def _qsl(q_lens):
    out = [0]
    for n in q_lens:
        out.append(out[-1] + n)
    return out


@pytest.mark.parametrize("ctx,ql,begin,want_sdpa,want_runs", [
    # decode rows 0-1, a long whole prompt, a chunk over a prefix, a short whole prompt, a long whole prompt
    ([50, 9, 40, 60, 5, 30], [1, 1, 40, 20, 5, 30], 2, [2, 5], [(3, 5, 20)]),
    ([50, 9, 40, 60, 5, 30], [1, 1, 40, 20, 5, 30], 0, [2, 5], [(0, 2, 1), (3, 5, 20)]),   # unified-like
    ([40, 30], [40, 30], 0, [0, 1], []),                                 # nothing left for the kernel
    ([40, 30, 60], [39, 29, 1], 0, [], [(0, 3, 39)]),                    # all over a prefix: one launch
    ([29, 30, 31], [29, 30, 31], 0, [1, 2], [(0, 1, 29)]),               # the threshold is inclusive
    ([10, 40, 10, 40, 10], [10, 40, 10, 40, 10], 0, [1, 3], [(0, 1, 10), (2, 3, 10), (4, 5, 10)]),
])
def test_split_prefill(ctx, ql, begin, want_sdpa, want_runs):
    route = split_prefill(_qsl(ql), ctx, begin, len(ctx), 30)
    assert route == PrefillRoute(want_sdpa, [], want_runs)
    _covers_each_once(route, begin, len(ctx))


def _covers_each_once(route, begin, end):
    covered = sorted(route.sdpa + route.flash + [s for a, b, _ in route.runs for s in range(a, b)])
    assert covered == list(range(begin, end))   # every prefill sequence exactly once


@pytest.mark.parametrize("ctx,ql,whole,prefix,want", [
    # decode rows 0-1, a long whole prompt, a long chunk over a prefix, a short chunk over one, a long whole prompt
    ([50, 9, 40, 60, 45, 30], [1, 1, 40, 35, 5, 30], 30, 30, ([2, 5], [3], [(4, 5, 5)])),
    ([50, 9, 40, 60, 45, 30], [1, 1, 40, 35, 5, 30], 0, 30, ([], [3], [(2, 3, 40), (4, 6, 30)])),   # SDPA off
    ([50, 9, 40, 60, 45, 30], [1, 1, 40, 35, 5, 30], 30, 36, ([2, 5], [], [(3, 5, 35)])),   # the chunk is short
    ([90, 80, 70], [40, 30, 29], 0, 30, ([], [0, 1], [(2, 3, 29)])),    # adjacent chunks; the threshold inclusive
    ([90, 20, 80], [40, 20, 50], 30, 30, ([], [0, 2], [(1, 2, 20)])),   # chunks apart, a short prompt between
    ([64], [64], 0, 30, ([], [], [(0, 1, 64)])),                        # a whole prompt is not a prefix chunk
])
def test_split_prefill_sends_long_chunks_over_a_prefix_to_the_varlen_op(ctx, ql, whole, prefix, want):
    begin = 2 if len(ctx) == 6 else 0
    route = split_prefill(_qsl(ql), ctx, begin, len(ctx), whole, prefix)
    assert route == PrefillRoute(*want)
    _covers_each_once(route, begin, len(ctx))


# ---- the varlen op's semantics and the ragged gather

def varlen_ref(q, k, v, cu_q, cu_k, max_q, max_k, scale, *, top_left=False):
    """FlashAttention-2's varlen forward with is_causal, in fp32: sequence s's queries q[cu_q[s]:cu_q[s+1]] over its
    keys k[cu_k[s]:cu_k[s+1]], the causal mask aligned to the bottom-right corner (query i of n sees keys
    [0, L - n + i]). top_left=True aligns it to the top-left instead (query i sees [0, i]): the wrong alignment, for
    the tests that must tell the two apart. Checks the bounds and layouts the real op needs."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    nq = [b - a for a, b in zip(cq, cq[1:])]
    nk = [b - a for a, b in zip(ck, ck[1:])]
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.is_contiguous() and cu_k.is_contiguous()
    assert max_q == max(nq) and max_k == max(nk) and cq[-1] == q.shape[0] and ck[-1] == k.shape[0]
    assert k.is_contiguous() and v.is_contiguous() and q.stride(-1) == 1
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for s, (n, length) in enumerate(zip(nq, nk)):
        first = torch.arange(n, device=q.device)[:, None] + (0 if top_left else length - n)
        mask = torch.arange(length, device=q.device)[None, :] <= first
        out[cq[s]:cq[s + 1]] = attend(q[None, cq[s]:cq[s + 1]], k[None, ck[s]:ck[s + 1]], v[None, ck[s]:ck[s + 1]],
                                      mask[None], scale)[0]
    return out


def _cu(xs):
    return torch.tensor(_qsl(xs), dtype=torch.int32)


def test_varlen_ref_is_the_paged_reference_of_chunks_over_a_prefix_and_top_left_is_not():
    ctx, ql = [70, 33, 120], [20, 33, 64]   # a chunk over 50 tokens, a whole prompt, a chunk over 56
    b = make_paged_batch(ctx, ql, 8, 2, 32, 16, torch.float32, "cpu", seed=5)
    kv_write_ref(b.k, b.v, b.k_cache, b.v_cache, b.slot_mapping)
    k = torch.cat([gather_kv(b.k_cache, b.block_tables[s], n) for s, n in enumerate(ctx)])
    v = torch.cat([gather_kv(b.v_cache, b.block_tables[s], n) for s, n in enumerate(ctx)])
    args = (b.q, k, v, _cu(ql), _cu(ctx), max(ql), max(ctx), 0.3)
    ref = paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_tables, ctx, b.query_start_list, 0.3)
    assert torch.allclose(varlen_ref(*args), ref, atol=1e-5)
    wrong = varlen_ref(*args, top_left=True)
    s1 = slice(b.query_start_list[1], b.query_start_list[2])   # whole prompt: the alignments agree
    assert torch.allclose(wrong[s1], ref[s1], atol=1e-5)
    for s in (0, 2):
        rows = slice(b.query_start_list[s], b.query_start_list[s + 1])
        assert (wrong[rows] - ref[rows]).abs().max() > 0.1, s


def test_the_ragged_gather_is_each_sequences_context_back_to_back():
    """Permuted block tables, a NaN-filled cache, contexts ending mid-block, sequences picked out of order: the
    gathered rows equal each sequence's own gather and no NaN (an unowned slot) comes along."""
    ctx = [37, 16, 100, 5, 64]
    b = make_paged_batch(ctx, [1] * len(ctx), 4, 2, 8, 16, torch.bfloat16, "cpu", seed=9)
    kv_write_ref(b.k, b.v, b.k_cache, b.v_cache, b.slot_mapping)
    pick = [4, 0, 2, 3]
    lens = torch.tensor([ctx[s] for s in pick], dtype=torch.int32)
    cu = _cu(lens.tolist())
    slots = ragged_kv_slots(b.block_tables[pick], lens, cu, int(cu[-1]), 16)
    for cache in (b.k_cache, b.v_cache):
        got = gather_kv_ragged(cache, slots)
        assert got.dtype == cache.dtype and got.is_contiguous() and not got.isnan().any()
        want = torch.cat([gather_kv(cache, b.block_tables[s], ctx[s]) for s in pick]).to(cache.dtype)
        assert torch.equal(got, want)


class FakeKernels:
    """The CUDA ops the backend launches, as their references (fp32 math, output in q's dtype), recording each
    prefill launch's (first sequence, end, max_query_len) and each SDPA call's row count."""

    def __init__(self, monkeypatch):
        self.launches, self.sdpa_rows, self.varlen_calls = [], [], []
        real_sdpa = ops.prefill_sdpa
        monkeypatch.setattr(ops, "kv_write", lambda k, v, kc, vc, slots, ks=None, vs=None:
                            kv_write_ref(k, v, kc, vc, slots))
        monkeypatch.setattr(ops, "paged_decode", self.decode)
        monkeypatch.setattr(ops, "paged_prefill", self.prefill)
        monkeypatch.setattr(ops, "prefill_sdpa", lambda q, k, v, scale: self.sdpa_rows.append(q.shape[0]) or
                            real_sdpa(q, k, v, scale))
        monkeypatch.setattr(ops, "prefill_flash_varlen", self.varlen)

    def varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, scale):
        self.varlen_calls.append((cu_q.tolist(), cu_k.tolist()))
        return varlen_ref(q, k, v, cu_q, cu_k, max_q, max_k, scale).to(q.dtype)

    def decode(self, out, q, kc, vc, bt, lens, scale, max_seq_len, **kw):
        out.copy_(paged_decode_ref(q, kc, vc, bt, lens.tolist(), scale))

    def prefill(self, out, q, kc, vc, bt, lens, qsl, scale, max_query_len, seq_begin, num_seqs, **kw):
        b, e = seq_begin, seq_begin + num_seqs
        starts = qsl.tolist()
        lo, hi = starts[b], starts[e]
        self.launches.append((b, e, max_query_len))
        out[lo:hi] = paged_attention_ref(q[lo:hi], kc, vc, bt[b:e], lens.tolist()[b:e],
                                         [x - lo for x in starts[b:e + 1]], scale).to(out.dtype)


# decode rows, a long whole prompt, a chunk over a prefix, a short whole prompt, a long whole prompt at the end
MIXED = ([40, 70, 200, 300, 20, 150], [1, 1, 200, 90, 20, 150])


@pytest.mark.parametrize("fused", [True, False])
def test_the_backend_sends_long_whole_prompts_to_sdpa_and_the_rest_to_the_kernels(monkeypatch, fused):
    """fused: the cache already holds the step's k/v (qk_norm_rope wrote it) and SDPA reads the prompt's blocks
    back; else forward() gets k/v, writes them and SDPA reads them directly. Either way: the reference's output."""
    fake = FakeKernels(monkeypatch)
    ctx, ql = MIXED
    b = make_paged_batch(ctx, ql, 8, 2, 32, 16, torch.float32, "cpu", seed=11)
    meta = paged_meta(b, num_decodes=2)
    if fused:
        kv_write_ref(b.k, b.v, b.k_cache, b.v_cache, b.slot_mapping)
    k, v = (None, None) if fused else (b.k, b.v)
    out = CudaAttentionBackend(prefill_sdpa_min_tokens=100).forward(b.q, k, v, b.k_cache, b.v_cache, meta, 0.2)
    assert fake.sdpa_rows == [200, 150]
    assert fake.launches == [(3, 5, 90)]   # the chunk over a prefix and the short prompt, in one launch
    if not fused:
        kv_write_ref(b.k, b.v, b.k_cache, b.v_cache, b.slot_mapping)   # the reference reads the written cache
    ref = paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_tables, ctx, b.query_start_list, 0.2)
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()


def test_without_a_threshold_the_backend_launches_the_kernel_once_as_before(monkeypatch):
    fake = FakeKernels(monkeypatch)
    ctx, ql = MIXED
    b = make_paged_batch(ctx, ql, 8, 2, 32, 16, torch.float32, "cpu", seed=12)
    # without its host lists: the backend must not need them (nor sync for them) when the route is off
    meta = dataclasses.replace(paged_meta(b, num_decodes=2), query_start_loc_cpu=None, seq_lens_cpu=None)
    CudaAttentionBackend().forward(b.q, b.k, b.v, b.k_cache, b.v_cache, meta, 0.2)
    assert fake.sdpa_rows == [] and fake.launches == [(2, 6, 200)]



# decode rows, a long whole prompt, a long chunk over a prefix, a short prompt, another long chunk over a prefix, a
# short chunk over one, a long whole prompt
MIXED_PREFIX = ([40, 70, 200, 300, 20, 250, 60, 150], [1, 1, 200, 90, 20, 120, 30, 150])


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("adjacent", [False, True])
def test_the_backend_sends_long_chunks_over_a_prefix_to_one_varlen_call(monkeypatch, fused, adjacent):
    """Chunks apart (a short prompt between: their query rows are copied together) or adjacent (one view); the
    K/V the op gets are their whole contexts from the cache, this step's rows included. The reference's output."""
    fake = FakeKernels(monkeypatch)
    ctx, ql = MIXED_PREFIX
    if adjacent:   # the short prompt moves after the second chunk
        order = [0, 1, 2, 3, 5, 4, 6, 7]
        ctx, ql = [ctx[i] for i in order], [ql[i] for i in order]
    b = make_paged_batch(ctx, ql, 8, 2, 32, 16, torch.float32, "cpu", seed=13)
    meta = paged_meta(b, num_decodes=2)
    if fused:
        kv_write_ref(b.k, b.v, b.k_cache, b.v_cache, b.slot_mapping)
    k, v = (None, None) if fused else (b.k, b.v)
    backend = CudaAttentionBackend(prefill_sdpa_min_tokens=100, prefill_prefix_min_tokens=80)
    out = backend.forward(b.q, k, v, b.k_cache, b.v_cache, meta, 0.2)
    assert fake.sdpa_rows == [200, 150]
    assert fake.varlen_calls == [([0, 90, 210], [0, 300, 550])]
    assert fake.launches == ([(4, 5, 20), (6, 7, 30)] if not adjacent else [(5, 7, 30)])
    if not fused:
        kv_write_ref(b.k, b.v, b.k_cache, b.v_cache, b.slot_mapping)
    ref = paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_tables, ctx, b.query_start_list, 0.2)
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()


def test_a_top_left_varlen_op_would_fail_the_backend_test(monkeypatch):
    """The check above can fail: with the op aligned top-left the chunks' rows are wrong."""
    fake = FakeKernels(monkeypatch)
    monkeypatch.setattr(ops, "prefill_flash_varlen", lambda q, k, v, cq, ck, mq, mk, scale:
                        varlen_ref(q, k, v, cq, ck, mq, mk, scale, top_left=True).to(q.dtype))
    ctx, ql = MIXED_PREFIX
    b = make_paged_batch(ctx, ql, 8, 2, 32, 16, torch.float32, "cpu", seed=13)
    out = CudaAttentionBackend(prefill_sdpa_min_tokens=100, prefill_prefix_min_tokens=80).forward(
        b.q, b.k, b.v, b.k_cache, b.v_cache, paged_meta(b, num_decodes=2), 0.2)
    ref = paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_tables, ctx, b.query_start_list, 0.2)
    chunk = slice(b.query_start_list[3], b.query_start_list[4])
    assert fake.launches and (out[chunk] - ref[chunk]).abs().max() > 0.1


def test_the_benchmark_times_the_route_on_the_engines_inputs():
    """prefill_bench's "sdpa engine route" row: q a strided view of qkv rows, k/v read back through the block
    table; on the CPU its output equals SDPA on the contiguous, gathered inputs."""
    import torch.nn.functional as F

    from minillm.diagnostics.kernel_check import _sdpa_route_impls

    t, hq, hkv, d, bs = 40, 4, 2, 16, 16
    nb = -(-t // bs)
    q, kc = torch.randn(t, hq, d), torch.randn(nb, bs, hkv, d)
    vc = torch.randn_like(kc)
    bt = torch.randperm(nb).to(torch.int32).view(1, -1)
    out = torch.full_like(q, float("nan"))
    (route,) = _sdpa_route_impls(out, q, kc, vc, bt, d ** -0.5).values()
    route()
    k4, v4 = (c[bt[0].long()].reshape(1, nb * bs, hkv, d)[:, :t].transpose(1, 2) for c in (kc, vc))
    ref = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k4, v4, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref[0].transpose(0, 1))

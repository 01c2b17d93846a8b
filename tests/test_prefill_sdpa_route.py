"""Long prefill chunks on cuDNN attention: whole prompts (the plan's prefill_sdpa verdict, kernels.prefill_sdpa /
prefill_sdpa_min_tokens) and chunks over a cached prefix (prefill_sdpa_prefix, kernels.prefill_sdpa_prefix): what
the plan records and why, the config checks, attention_ops.prefill_cudnn's rounded calls and their merge (cuDNN
replaced by a reference of its op), and which rows of a step the CUDA backend sends where (the paged kernels and
prefill_cudnn replaced by references). tests/test_prefill_sdpa_gpu.py runs the real ones."""
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
from minillm.ops.reference import attend, kv_write_ref, make_paged_batch, paged_attention_ref, paged_decode_ref
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
    assert plan(device=A100).prefill_sdpa.on    # cuDNN attention runs on sm_80


def test_the_plan_records_chunks_over_a_prefix_on_cudnn():
    p = plan()
    assert p.prefill_sdpa_prefix.on
    assert p.prefill_prefix_min_tokens == EngineConfig().kernels.prefill_sdpa_prefix_min_tokens
    rec = p.record()["plan"]["prefill_sdpa_prefix"]
    assert rec == {"on": True, "reason": p.prefill_sdpa_prefix.reason, "min_tokens": p.prefill_prefix_min_tokens}
    assert "over a cached prefix" in rec["reason"] and "prefill_sdpa_prefix=on" in p.describe()
    assert "chunks over a prefix on cuDNN" in p.prefill_sdpa.reason
    assert plan(prefill_sdpa_prefix_min_tokens=300).prefill_prefix_min_tokens == 300
    assert ">= 300 queries" in plan(prefill_sdpa_prefix_min_tokens=300).prefill_sdpa_prefix.reason
    assert plan(device=A100).prefill_sdpa_prefix.on


@pytest.mark.parametrize("kw,why", [
    (dict(prefill_sdpa_prefix=False), "kernels.prefill_sdpa_prefix=false"),
    (dict(prefill_sdpa=False), "whole prompts on cuDNN, which is off (kernels.prefill_sdpa=false)"),
    (dict(kv_cache_dtype="fp8"), "quantized"),
    (dict(attention_mode="unified"), "unified"),
    (dict(kernels="torch"), "prefill kernel, which is off"),
])
def test_the_prefix_route_is_off_where_it_does_not_apply_and_says_why(kw, why):
    p = plan(**kw)
    assert not p.prefill_sdpa_prefix.on and why in p.prefill_sdpa_prefix.reason
    assert p.prefill_prefix_min_tokens == 0 and p.record()["plan"]["prefill_sdpa_prefix"]["on"] is False
    if kw == dict(prefill_sdpa_prefix=False):   # whole prompts keep cuDNN; its reason says where chunks go
        assert p.prefill_sdpa.on and "chunks over a prefix on the prefill kernel" in p.prefill_sdpa.reason


def test_without_cudnn_attention_in_torch_every_prefill_row_stays_on_the_kernel(monkeypatch):
    monkeypatch.setattr(ops, "cudnn_attention_available", lambda: False)
    p = plan()
    assert not p.prefill_sdpa.on and not p.prefill_sdpa_prefix.on
    assert "no cuDNN attention" in p.prefill_sdpa.reason and p.prefill_sdpa_min_tokens == 0


def test_the_op_is_in_this_torch_and_takes_the_arguments_prefill_cudnn_passes():
    args = [a.name for a in torch.ops.aten._scaled_dot_product_cudnn_attention.default._schema.arguments]
    assert args[:8] == ["query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal",
                        "return_debug_mask"] and "scale" in args


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


@pytest.mark.parametrize("key", ["prefill_sdpa_min_tokens", "prefill_sdpa_prefix_min_tokens"])
@pytest.mark.parametrize("bad", [0, -1, 1 << 25])
def test_a_bad_threshold_is_a_config_error_naming_the_key(bad, key):
    with pytest.raises(ConfigError, match=re.escape(f"kernels.{key}={bad} is not allowed")):
        EngineConfig.from_kwargs(**{key: bad})
    with pytest.raises(ConfigError, match=re.escape(f"kernels.{key}")):
        load_config(None, [f"kernels.{key}={bad}"])
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
    covered = sorted(route.whole + route.prefixed + [s for a, b, _ in route.runs for s in range(a, b)])
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
def test_split_prefill_sends_long_chunks_over_a_prefix_to_cudnn(ctx, ql, whole, prefix, want):
    begin = 2 if len(ctx) == 6 else 0
    route = split_prefill(_qsl(ql), ctx, begin, len(ctx), whole, prefix)
    assert route == PrefillRoute(*want)
    _covers_each_once(route, begin, len(ctx))


# ---- prefill_cudnn: rounded call shapes, and the merge of its two calls

def attention_ref(q, k, v, scale):
    """Causal attention in fp32 of q's n rows as the last n of k/v's L (query i sees keys [0, L - n + i])."""
    n, length = q.shape[0], k.shape[0]
    mask = torch.arange(length)[None, :] <= torch.arange(n)[:, None] + (length - n)
    return attend(q[None], k[None], v[None], mask[None], scale)[0]


class FakeCudnn:
    """aten's cuDNN op as prefill_cudnn calls it, in fp32 (top-left causal, as cuDNN's is_causal), recording each
    call's (query rows, key rows, causal): their lengths must be the rounded ones, their layouts one per shape."""

    def __init__(self, monkeypatch):
        self.calls = []
        monkeypatch.setattr(ops, "_cudnn_call", self)

    def __call__(self, q, k, v, causal, scale):
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        rows, keys = q.shape[0], k.shape[0]
        self.calls.append((rows, keys, causal))
        mask = torch.arange(keys)[None, :] <= torch.arange(rows)[:, None] if causal else torch.ones(rows, keys,
                                                                                                      dtype=torch.bool)
        g = q.shape[1] // k.shape[1]
        s = torch.einsum("qhd,khd->hqk", q.float(), k.float().repeat_interleave(g, 1)) * scale
        s = s.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(s, -1, keepdim=True)
        out = torch.einsum("hqk,khd->hqd", torch.exp(s - lse), v.float().repeat_interleave(g, 1))
        return out.to(q.dtype), lse


@pytest.mark.parametrize("n,ctx,want", [
    (300, 300, [(512, 512, True)]),                               # a whole prompt: one causal call, padded
    (40, 100, [(256, 256, True)]),                                # a prefix under one quantum: folded in whole
    (100, 5000, [(256, 256, True), (256, 4864, False)]),          # 4864 prefix rows apart, 36 folded in
    (256, 4352, [(256, 256, True), (256, 4096, False)]),          # the prefix a whole number of quanta
    (1100, 20000, [(1792, 1792, True), (1280, 18432, False)]),    # 18 quanta of 1024 apart, 468 + 1100 folded
])
def test_prefill_cudnn_is_causal_attention_over_the_context_in_rounded_calls(monkeypatch, n, ctx, want):
    fake = FakeCudnn(monkeypatch)
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(rows, heads, 16, generator=g) for rows, heads in ((n, 4), (ctx, 2), (ctx, 2)))
    out = ops.prefill_cudnn(q, k, v, 0.25)
    assert fake.calls == want
    assert all(r % 256 == 0 and c % 256 == 0 for r, c, _ in fake.calls)
    torch.testing.assert_close(out, attention_ref(q, k, v, 0.25), atol=1e-5, rtol=1e-5)


def test_the_check_can_fail_a_merge_that_drops_the_prefix_share(monkeypatch):
    FakeCudnn(monkeypatch)
    monkeypatch.setattr(ops.torch, "sigmoid", lambda x: torch.zeros_like(x))
    q, k, v = torch.randn(100, 4, 16), torch.randn(5000, 2, 16), torch.randn(5000, 2, 16)
    assert (ops.prefill_cudnn(q, k, v, 0.25) - attention_ref(q, k, v, 0.25)).abs().max() > 0.01


@pytest.mark.parametrize("n,step", [(1, 256), (4095, 256), (4096, 256), (8191, 256), (8192, 512), (40000, 2048),
                                    (131072, 8192)])
def test_cudnn_quantum_is_a_sixteenth_of_the_octave_and_at_least_256(n, step):
    assert ops.cudnn_quantum(n) == step


class FakeKernels:
    """The CUDA ops the backend launches, as their references (fp32 math, output in q's dtype), recording each
    prefill launch's (first sequence, end, max_query_len) and each cuDNN call's (query rows, context rows)."""

    def __init__(self, monkeypatch):
        self.launches, self.cudnn_calls = [], []
        monkeypatch.setattr(ops, "kv_write", lambda k, v, kc, vc, slots, ks=None, vs=None:
                            kv_write_ref(k, v, kc, vc, slots))
        monkeypatch.setattr(ops, "paged_decode", self.decode)
        monkeypatch.setattr(ops, "paged_prefill", self.prefill)
        monkeypatch.setattr(ops, "prefill_cudnn", self.cudnn)

    def cudnn(self, q, k, v, scale):
        self.cudnn_calls.append((q.shape[0], k.shape[0]))
        return attention_ref(q, k, v, scale).to(q.dtype)

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
def test_the_backend_sends_long_whole_prompts_to_cudnn_and_the_rest_to_the_kernels(monkeypatch, fused):
    """fused: the cache already holds the step's k/v (qk_norm_rope wrote it) and the prompt's blocks are read back;
    else forward() gets k/v, writes them and cuDNN reads them directly. Either way: the reference's output."""
    fake = FakeKernels(monkeypatch)
    ctx, ql = MIXED
    b = make_paged_batch(ctx, ql, 8, 2, 32, 16, torch.float32, "cpu", seed=11)
    meta = paged_meta(b, num_decodes=2)
    if fused:
        kv_write_ref(b.k, b.v, b.k_cache, b.v_cache, b.slot_mapping)
    k, v = (None, None) if fused else (b.k, b.v)
    out = CudaAttentionBackend(prefill_sdpa_min_tokens=100).forward(b.q, k, v, b.k_cache, b.v_cache, meta, 0.2)
    assert fake.cudnn_calls == [(200, 200), (150, 150)]
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
    assert fake.cudnn_calls == [] and fake.launches == [(2, 6, 200)]



# decode rows, a long whole prompt, a long chunk over a prefix, a short prompt, another long chunk over a prefix, a
# short chunk over one, a long whole prompt
MIXED_PREFIX = ([40, 70, 200, 300, 20, 250, 60, 150], [1, 1, 200, 90, 20, 120, 30, 150])


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("adjacent", [False, True])
def test_the_backend_sends_long_chunks_over_a_prefix_to_cudnn(monkeypatch, fused, adjacent):
    """Chunks apart (a short prompt between) or adjacent; the K/V each call gets are the chunk's whole context from
    the cache, this step's rows included. The reference's output."""
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
    assert sorted(fake.cudnn_calls) == [(90, 300), (120, 250), (150, 150), (200, 200)]
    assert fake.launches == ([(4, 5, 20), (6, 7, 30)] if not adjacent else [(5, 7, 30)])
    if not fused:
        kv_write_ref(b.k, b.v, b.k_cache, b.v_cache, b.slot_mapping)
    ref = paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_tables, ctx, b.query_start_list, 0.2)
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()


def test_a_top_left_route_would_fail_the_backend_test(monkeypatch):
    """The check above can fail: with the chunks' queries aligned to the start of their contexts the rows are
    wrong."""
    fake = FakeKernels(monkeypatch)
    monkeypatch.setattr(ops, "prefill_cudnn", lambda q, k, v, scale: attention_ref(q, k[:q.shape[0]], v[:q.shape[0]],
                                                                                   scale).to(q.dtype))
    ctx, ql = MIXED_PREFIX
    b = make_paged_batch(ctx, ql, 8, 2, 32, 16, torch.float32, "cpu", seed=13)
    out = CudaAttentionBackend(prefill_sdpa_min_tokens=100, prefill_prefix_min_tokens=80).forward(
        b.q, b.k, b.v, b.k_cache, b.v_cache, paged_meta(b, num_decodes=2), 0.2)
    ref = paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_tables, ctx, b.query_start_list, 0.2)
    chunk = slice(b.query_start_list[3], b.query_start_list[4])
    assert fake.launches and (out[chunk] - ref[chunk]).abs().max() > 0.1


@pytest.mark.parametrize("q_len", [40, 25])
def test_the_benchmark_times_the_route_on_the_engines_inputs(monkeypatch, q_len):
    """prefill_bench's "cudnn engine route" row: q a strided view of qkv rows, k/v read back through the block
    table (a whole prompt, and a chunk over a prefix); on the CPU, with cuDNN's reference, its output equals
    causal attention on the contiguous, gathered inputs."""
    from minillm.diagnostics.kernel_check import _cudnn_route_impls

    FakeCudnn(monkeypatch)
    t, hq, hkv, d, bs = 40, 4, 2, 16, 16
    nb = -(-t // bs)
    q, kc = torch.randn(q_len, hq, d), torch.randn(nb, bs, hkv, d)
    vc = torch.randn_like(kc)
    bt = torch.randperm(nb).to(torch.int32).view(1, -1)
    out = torch.full_like(q, float("nan"))
    (route,) = _cudnn_route_impls(out, q, kc, vc, bt, t, d ** -0.5).values()
    route()
    k, v = (c[bt[0].long()].reshape(nb * bs, hkv, d)[:t] for c in (kc, vc))
    torch.testing.assert_close(out, attention_ref(q, k, v, d ** -0.5), atol=1e-5, rtol=1e-5)

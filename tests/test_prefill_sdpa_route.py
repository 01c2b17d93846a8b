"""Whole prompts on torch SDPA (the plan's prefill_sdpa verdict, kernels.prefill_sdpa / prefill_sdpa_min_tokens):
what the plan records and why, the config checks, and which rows of a step the CUDA backend sends where. The
backend test runs on the CPU with the paged kernels replaced by their references; tests/test_prefill_sdpa_gpu.py
runs the real ones."""
import dataclasses
import re

import pytest
import torch

from minillm.attention.cuda_backend import CudaAttentionBackend, split_prefill
from minillm.cache.spec import KVCacheSpec
from minillm.config import ConfigError, EngineConfig
from minillm.config_loader import load_config
from minillm.diagnostics import paged_meta
from minillm.model.loader import resolve_arch
from minillm.ops import attention_ops as ops
from minillm.ops.reference import kv_write_ref, make_paged_batch, paged_attention_ref, paged_decode_ref
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


def test_an_fp8_cache_is_refused_by_a_backend_with_the_route():
    arch = resolve_arch("qwen3-0.6b")
    spec = KVCacheSpec.for_model(arch, 16, "fp8", torch.bfloat16)
    CudaAttentionBackend().bind_kv_cache(spec)   # no threshold: the narrow kernel reads it
    with pytest.raises(ValueError, match="not fp8"):
        CudaAttentionBackend(prefill_sdpa_min_tokens=16).bind_kv_cache(spec)


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
    sdpa, runs = split_prefill(_qsl(ql), ctx, begin, len(ctx), 30)
    assert (sdpa, runs) == (want_sdpa, want_runs)
    covered = sorted(sdpa + [s for a, b, _ in runs for s in range(a, b)])
    assert covered == list(range(begin, len(ctx)))   # every prefill sequence exactly once


class FakeKernels:
    """The CUDA ops the backend launches, as their references (fp32 math, output in q's dtype), recording each
    prefill launch's (first sequence, end, max_query_len) and each SDPA call's row count."""

    def __init__(self, monkeypatch):
        self.launches, self.sdpa_rows = [], []
        real_sdpa = ops.prefill_sdpa
        monkeypatch.setattr(ops, "kv_write", lambda k, v, kc, vc, slots, ks=None, vs=None:
                            kv_write_ref(k, v, kc, vc, slots))
        monkeypatch.setattr(ops, "paged_decode", self.decode)
        monkeypatch.setattr(ops, "paged_prefill", self.prefill)
        monkeypatch.setattr(ops, "prefill_sdpa", lambda q, k, v, scale: self.sdpa_rows.append(q.shape[0]) or
                            real_sdpa(q, k, v, scale))

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


"""On a GPU: whole prompts on torch SDPA (the plan's prefill_sdpa route) against the paged prefill kernel and the
fp32 reference, on mixed steps (decode rows, long whole prompts, a chunk over a prefix, a short prompt), with the
KV write fused (SDPA reads the prompt's blocks back) and not (SDPA reads this step's k/v); SDPA's flash path takes
the layouts the backend hands it; and the engine's greedy tokens with the route on and off on a tiny random model.
"""
import random

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.attention.cuda_backend import CudaAttentionBackend
from minillm.diagnostics import paged_meta
from minillm.diagnostics.kernel_check import prefill_ref_chunked
from minillm.ops import attention_ops as ops
from minillm.ops.reference import kv_write_ref, make_paged_batch
from test_prefill_kernels import TOL
from tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.gpu

# decode rows, a long whole prompt, a chunk over a prefix, a short whole prompt, a long whole prompt at the end
CTX = [900, 37, 3000, 4000, 200, 2500]
QL = [1, 1, 3000, 1000, 200, 2500]
MIN_TOKENS = 1024


@pytest.fixture(scope="module")
def ext():
    from minillm.ops.build import load_extension

    load_extension()


def _forward(b, meta, fused: bool, min_tokens: int, scale: float) -> torch.Tensor:
    backend = CudaAttentionBackend(prefill_sdpa_min_tokens=min_tokens)
    k, v = (None, None) if fused else (b.k, b.v)
    out = backend.forward(b.q, k, v, b.k_cache, b.v_cache, meta, scale)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("d,hq,hkv,dtype", [(128, 16, 8, torch.bfloat16), (128, 32, 8, torch.bfloat16),
                                            (64, 12, 4, torch.float16), (128, 8, 1, torch.float16)])
def test_a_mixed_step_with_the_route_equals_the_kernel_and_the_reference(ext, fused, d, hq, hkv, dtype):
    b = make_paged_batch(CTX, QL, hq, hkv, d, 16, dtype, "cuda", seed=d + hq)
    meta, scale = paged_meta(b, num_decodes=2), d ** -0.5
    if fused:   # qk_norm_rope stored the step's k/v before forward()
        kv_write_ref(b.k, b.v, b.k_cache, b.v_cache, b.slot_mapping)
    routed = _forward(b, meta, fused, MIN_TOKENS, scale)
    kernel = _forward(b, meta, fused, 0, scale)
    kv_write_ref(b.k, b.v, b.k_cache, b.v_cache, b.slot_mapping)   # unfused: forward() wrote the same values
    ref = prefill_ref_chunked(b, scale)
    lo = b.query_start_list[2]   # the decode rows' reference is the decode kernel's test; here they must agree
    for name, out in (("routed", routed), ("kernel", kernel)):
        err = (out[lo:].float() - ref[lo:]).abs().max().item()
        assert err < TOL[dtype], (name, err)
    assert torch.equal(routed[:lo], kernel[:lo])   # decode rows: the same kernel either way
    s2, s5 = slice(b.query_start_list[2], b.query_start_list[3]), slice(b.query_start_list[5], None)
    assert (routed[s2].float() - kernel[s2].float()).abs().max().item() < TOL[dtype]
    assert (routed[s5].float() - kernel[s5].float()).abs().max().item() < TOL[dtype]
    mid = slice(b.query_start_list[3], b.query_start_list[5])   # the kernel ran these rows in both
    assert torch.equal(routed[mid], kernel[mid])


def test_the_routes_sdpa_call_runs_on_flash(ext):
    """The views the backend passes (the [L, H, D] rows seen as [1, H, L, D], GQA not expanded) are what SDPA's
    flash path takes: with only flash allowed it must run, and equal the reference."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b = make_paged_batch([2048], [2048], 16, 8, 128, 16, torch.bfloat16, "cuda", seed=3)
    kv_write_ref(b.k, b.v, b.k_cache, b.v_cache, b.slot_mapping)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = ops.prefill_sdpa(b.q, b.k, b.v, 128 ** -0.5)
    err = (out.float() - prefill_ref_chunked(b, 128 ** -0.5)).abs().max().item()
    assert err < TOL[torch.bfloat16], err


# ---- end to end

VOCAB, NEW_TOKENS, ROUTE_MIN = 1024, 12, 512
TIE_NATS, MAX_FIRST_LOGPROB_DIFF = 0.35, 0.25   # tests/test_engine_e2e_gpu.py's near-tie bound; half its error bound


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("sdpa-route"), "qwen3", hidden=256, heads=8, kv_heads=2,
                                head_dim=128, intermediate=512, vocab=VOCAB, layers=2, max_positions=2200, seed=5)


def _prompts() -> list[list[int]]:
    """A 1,500-token prompt (whole, on SDPA); a 1,200-token one sharing 1,024 tokens with it, which the 2,048-token
    budget splits into a first chunk of 548 (SDPA) and the rest over that prefix (kernel); short prompts."""
    rng = random.Random(3)
    a = [rng.randrange(VOCAB) for _ in range(1500)]
    b = a[:1024] + [rng.randrange(VOCAB) for _ in range(176)]
    return [a, b] + [[rng.randrange(VOCAB) for _ in range(n)] for n in (100, 7, 600)]


def _run(ckpt, monkeypatch, **kw):
    calls = []
    real = ops.prefill_sdpa
    monkeypatch.setattr(ops, "prefill_sdpa", lambda q, k, v, scale: calls.append(q.shape[0]) or real(q, k, v, scale))
    llm = LLM(str(ckpt), device="cuda", dtype="bfloat16", kernels="cuda", max_model_len=2100, num_kv_blocks=1024,
              max_num_batched_tokens=2048, max_num_seqs=8, prefill_sdpa_min_tokens=ROUTE_MIN, **kw)
    assert llm.engine.runner.graphs is not None   # decode graphs captured as before
    outs = llm.generate(_prompts(), SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS,
                                                   logprobs=5), use_tqdm=False)
    return llm, outs, calls


def test_greedy_tokens_with_the_route_on_and_off(ext, ckpt, monkeypatch):
    on_llm, on, on_calls = _run(ckpt, monkeypatch)
    assert on_llm.engine.runner.plan.prefill_sdpa_min_tokens == ROUTE_MIN
    assert on_calls and min(on_calls) >= ROUTE_MIN and 1500 in on_calls, on_calls
    del on_llm
    off_llm, off, off_calls = _run(ckpt, monkeypatch, prefill_sdpa=False)
    assert off_calls == [] and not off_llm.engine.runner.plan.prefill_sdpa.on
    same = 0
    for i, (x, y) in enumerate(zip(on, off)):
        assert abs(x.logprobs[0].logprob - y.logprobs[0].logprob) <= MAX_FIRST_LOGPROB_DIFF, i
        k = next((j for j, (a, b) in enumerate(zip(x.token_ids, y.token_ids)) if a != b), None)
        if k is None:
            same += 1
            continue
        # A bf16 near-tie may flip: the route's token must be within TIE_NATS of the best in the other run.
        top = y.logprobs[k].top
        assert x.token_ids[k] in top and max(top.values()) - top[x.token_ids[k]] <= TIE_NATS, (i, k)
    # No bound on how many flip at near-ties (tests/test_engine_e2e_gpu.py explains why); the bounds above catch
    # an attention path that is off.
    print(f"{same} of {len(on)} prompts gave the same greedy tokens with the route on and off")

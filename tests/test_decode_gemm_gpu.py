"""GPU checks of the decode GEMM (torch.ops.minillm.decode_gemm) against F.linear in fp32: every linear layer of the
dense Qwen3 / Qwen2.5 models at decode batch sizes, both dtypes, every row count, every legal (splits, row_warps)
on a few shapes, NaN-poisoned outputs, PDL launches and the binding's refusals. Skipped without CUDA (or off sm_90)."""
import pytest
import torch
import torch.nn.functional as F

from minillm.ops import decode_gemm as dg
from test_decode_gemm import DECODE_SHAPES

pytestmark = pytest.mark.gpu

ROWS = [1, 2, 3, 5, 7, 8, 9, 13, 16, 17, 24, 31, 32, 33, 48, 63, 64]
DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def ops():
    from minillm.ops.build import load_extension
    load_extension()
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the decode GEMM is built for sm_90")
    return torch.ops.minillm


def _inputs(m, n, k, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) * k ** -0.5
    return x, w


def _check(y, x, w):
    ref = F.linear(x.float(), w.float())
    assert y.dtype == x.dtype and y.shape == ref.shape
    assert not torch.isnan(y).any()
    err = (y.float() - ref).abs().max().item()
    # fp32 accumulation in both; the gap is the output rounding (bf16: 2^-8 relative) and summation order.
    assert err <= 1e-2 * ref.abs().max().item() + 1e-3, err


@pytest.mark.parametrize("n,k", DECODE_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_qwen_shape_matches_fp32(ops, n, k, dtype):
    for m in (1, 8, 16, 32, 64):
        x, w = _inputs(m, n, k, dtype, seed=m * 31 + n + k)
        _check(dg.decode_gemm(x, w), x, w)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_row_count(ops, m, dtype):
    for n, k in [(1152, 896), (4096, 1024), (1024, 3072)]:
        x, w = _inputs(m, n, k, dtype, seed=m)
        _check(dg.decode_gemm(x, w), x, w)


@pytest.mark.parametrize("m", [1, 9, 17, 33, 64])
def test_every_config(ops, m):
    n, k = 1024, 896   # 28 k32 blocks: uneven warp ranges for most (splits, row_warps)
    x, w = _inputs(m, n, k, torch.bfloat16, seed=5)
    for s, rw in dg.configs(k):
        _check(ops.decode_gemm(x, w, s, rw), x, w)


@pytest.mark.parametrize("m", [1, 17, 33, 64])
def test_every_output_element_is_written(ops, m):
    """The caching allocator hands the freed NaN block to the next output of the same size."""
    n, k = 4096, 1024
    x, w = _inputs(m, n, k, torch.bfloat16, seed=9)
    for s, rw in ((1, 1), (3, 2), (8, 8), (4, 1)):
        poison = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        ptr = poison.data_ptr()
        del poison
        y = ops.decode_gemm(x, w, s, rw)
        assert y.data_ptr() == ptr   # the output really is the poisoned block
        _check(y, x, w)


def test_strided_and_misaligned_x(ops):
    n, k = 2048, 1024
    base, w = _inputs(40, n, k + 8, torch.bfloat16, seed=3)
    w = w[:, :k].contiguous()
    for x in (base[:, :k], base[:, 1:k + 1], base[::2, :k]):   # row stride k + 8; odd start; every other row
        _check(dg.decode_gemm(x, w), x, w)


def test_under_pdl_and_in_a_cuda_graph(ops):
    """Captured with programmatic dependent launch right behind the kernels that write x: x must be read only after
    the wait (the weights are issued before it), and replays must keep giving the product."""
    n, k, m = 6144, 1024, 32
    x0, w = _inputs(m, n, k, torch.bfloat16, seed=11)
    norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    x = torch.empty_like(x0)
    previous = ops.set_pdl_launches(True)
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            normed = ops.rms_norm(x0, norm_w, 1e-6)   # a minillm kernel (PDL-launched) right before
            y = ops.decode_gemm(normed, w, 4, 8)
            x.copy_(x0)                                # a torch kernel right before
            y2 = ops.decode_gemm(x, w, 1, 1)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
    finally:
        ops.set_pdl_launches(previous)
    _check(y, normed, w)
    _check(y2, x0, w)


@pytest.mark.parametrize("bad,words", [
    (lambda x, w: (x[:, :1000], w[:, :1000].contiguous(), 1, 8), "K must be"),
    (lambda x, w: (x, w[:1000].contiguous(), 1, 8), "N must be"),
    (lambda x, w: (x, w, 0, 8), "splits"),
    (lambda x, w: (x, w, 9, 8), "splits"),
    (lambda x, w: (x, w, 1, 3), "row_warps"),
    (lambda x, w: (x, w, 1, 16), "row_warps"),
    (lambda x, w: (x[:, :32], w[:, :32].contiguous(), 2, 8), "splits"),
    (lambda x, w: (x[:, :64], w[:, :64].contiguous(), 1, 2), "splits"),
    (lambda x, w: (x.float(), w.float(), 1, 8), "dtype"),
    (lambda x, w: (x, w.half(), 1, 8), "dtype"),
    (lambda x, w: (torch.cat([x] * 17), w, 1, 8), "at most 64"),
    (lambda x, w: (x, w.t().contiguous().t(), 1, 8), "contiguous"),
])
def test_binding_refuses_what_covers_refuses(ops, bad, words):
    x, w = _inputs(4, 1024, 1024, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match=words):
        ops.decode_gemm(*bad(x, w))


@pytest.mark.parametrize("m,n,k", [(1, 128, 32), (64, 1152, 896), (65, 1024, 1024), (4, 1088, 1024),
                                   (4, 1024, 992), (4, 1024, 32), (4, 1024, 1000), (16, 64, 1024)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_binding_agrees_with_covers(ops, m, n, k, dtype):
    x, w = _inputs(m, n, k, dtype, seed=2)
    reason = dg.covers(m, n, k, dtype, torch.cuda.get_device_capability()[0])
    if reason is None:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        _check(ops.decode_gemm(x, w, *dg.choose_config(m, n, k, sms)), x, w)
    else:
        with pytest.raises(ValueError):
            ops.decode_gemm(x, w, 1, 8)


def test_wrapper_raises_the_covers_reason(ops):
    x, w = _inputs(65, 1024, 1024, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match=r"does not apply: rows must be in \[1, 64\]"):
        dg.decode_gemm(x, w)


# ---- in an engine: the plan's layers on the kernel give the tokens they give on cuBLAS / the skinny GEMM ---------

TINY = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512)   # o_proj [256, 256], down [256, 512]


def _engine(path, **kw):
    from minillm import LLM
    return LLM(str(path), device="cuda", dtype="bfloat16", kernels="cuda", megakernel=False, max_model_len=512,
               num_kv_blocks=256, max_num_seqs=16, **kw)


def _kernel_names(llm, prompt) -> set[str]:
    """Names of the GPU kernels one short generate ran (device events only, not the ops that launched them)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from minillm import SamplingParams
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate([prompt], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2), use_tqdm=False)
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type == DeviceType.CUDA}
    assert names, "the profiler saw no GPU kernel"
    return names


def test_engine_on_the_decode_gemm_gives_the_same_greedy_tokens(ops, tmp_path, monkeypatch):
    """The table patched to the tiny model's o_proj and down_proj: the engine (CUDA graphs on) gives the greedy
    tokens of the same engine with kernels.decode_gemm=false, except at near-ties (the rule of
    tests/test_engine_e2e_gpu.py: at the first divergence our token is within TIE_NATS of the best in HF's fp32
    log-probabilities), and the profiler sees the kernel run."""
    import random

    from minillm import SamplingParams
    from test_engine_e2e_gpu import HF, MAX_LOGPROB_ERR, TIE_NATS
    from tiny_models import make_tiny_checkpoint

    h, i = TINY["hidden"], TINY["intermediate"]
    monkeypatch.setattr(dg, "MEASURED_WINS", {(h, TINY["heads"] * TINY["head_dim"]): 16, (h, i): 16})
    path = make_tiny_checkpoint(tmp_path / "ckpt", "qwen3", vocab=1024, layers=2, max_positions=576,
                                dtype=torch.bfloat16, seed=3, **TINY)
    on, off = _engine(path), _engine(path, decode_gemm=False)
    plan = on.engine.runner.plan
    assert {n for n, v in plan.decode_gemm.items() if v.on} == {"o_proj", "down_proj"}, plan.describe()
    assert plan.cuda_graphs.on and on.engine.runner.graphs is not None
    assert not any(v.on for v in off.engine.runner.plan.decode_gemm.values())

    rng = random.Random(5)
    prompts = [[rng.randrange(1024) for _ in range(n)] for n in (1, 3, 9, 16, 40, 200)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12, logprobs=0)
    got = on.generate(prompts, params, use_tqdm=False)
    want = off.generate(prompts, params, use_tqdm=False)
    hf = HF(path)
    for prompt, a, b in zip(prompts, got, want):
        assert abs(a.logprobs[0].logprob - b.logprobs[0].logprob) <= MAX_LOGPROB_ERR
        k = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if k is None:
            continue
        lp = hf.logprobs(prompt + a.token_ids[:k])
        margin = (lp.max() - lp[a.token_ids[k]]).item()
        assert margin <= TIE_NATS, f"prompt of {len(prompt)} tokens: token {k} is {a.token_ids[k]} with the " \
            f"decode GEMM, {b.token_ids[k]} without, {margin:.3f} nats below HF's best"

    # a 5-token prompt: its prefill (5 rows, eager) and decode steps take the kernel; the same check finds none
    # with the kernel off, so it can fail
    assert any("decode_gemm" in n for n in _kernel_names(on, prompts[2][:5]))
    assert not any("decode_gemm" in n for n in _kernel_names(off, prompts[2][:5]))

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

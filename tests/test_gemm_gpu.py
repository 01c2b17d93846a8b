"""GPU checks of the skinny GEMM (torch.ops.minillm.skinny_gemm) against an fp32 product, at every tile height and
K split, on the linear-layer shapes of Qwen3-0.6B and small odd ones. Skipped without CUDA (or below sm_90)."""
import pytest
import torch

from minillm.ops import gemm_ops

pytestmark = pytest.mark.gpu

SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (128, 512)]   # (N, K)
ROWS = [1, 5, 16, 17, 32, 33, 64, 100, 128, 130, 256]


@pytest.fixture(scope="module")
def ops():
    from minillm.ops.build import load_extension
    load_extension()
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need sm_90")
    return torch.ops.minillm


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = x.float() @ w.float().T
    err = (y.float() - ref).abs().max().item()
    assert y.dtype == x.dtype and y.shape == ref.shape
    assert err <= 1e-2 * ref.abs().max().item() + 1e-3, err


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_auto_splits_match_fp32(ops, n, k, m, dtype):
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) * 0.05
    splits = gemm_ops.gemm_splits(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    torch.full((m, n), float("nan"), device="cuda", dtype=dtype)  # poison the block the output will reuse
    _check(ops.skinny_gemm(x, w, splits), x, w)


@pytest.mark.parametrize("splits", [1, 2, 4, 8])
@pytest.mark.parametrize("m", [3, 48, 200])
def test_every_split_and_strided_rows(ops, splits, m):
    x_big = torch.randn(m, 2048 + 64, device="cuda", dtype=torch.bfloat16)
    x = x_big[:, 64:]   # rows 16-byte aligned, stride != K
    w = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16) * 0.05
    _check(ops.skinny_gemm(x, w, splits), x, w)


def test_linear_dispatch(ops):
    """The layer shape is decided by the plan (gemm_ops.shape_reason); the call only asks the row count."""
    x = torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16) * 0.05
    assert gemm_ops.shape_reason(1024, 2048, bias=False) is None
    assert "bias" in gemm_ops.shape_reason(1024, 2048, bias=True)
    assert "4096" in gemm_ops.shape_reason(4096, 2048, bias=False)
    _check(gemm_ops.linear(x, w, skinny=True), x, w)
    x40 = torch.randn(40, 2048, device="cuda", dtype=torch.bfloat16)   # over MAX_ROWS: cuBLAS
    assert torch.equal(gemm_ops.linear(x40, w, skinny=True), torch.nn.functional.linear(x40, w))
    assert torch.equal(gemm_ops.linear(x, w), torch.nn.functional.linear(x, w))   # skinny=False: cuBLAS


@pytest.mark.parametrize("n,k,splits,match", [(1000, 1024, 1, "multiple of 128"), (1024, 1000, 1, "K must be"),
                                                 (1024, 1024, 3, "splits must be"), (1024, 1024, 32, "splits must")])
def test_bad_shapes_raise(ops, n, k, splits, match):
    x = torch.randn(4, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        ops.skinny_gemm(x, w, splits)


def test_l2_prefetch_changes_nothing(ops):
    """l2_prefetch (scripts/gemm_l2_probe.py) only asks L2 for bytes: tensors and a product read after it are
    unchanged, and a list it cannot take is refused with a message."""
    g = torch.Generator(device="cuda").manual_seed(3)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) for n, k in SHAPES]
    before = [w.clone() for w in ws]
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16, generator=g)
    ref = x @ ws[0].T
    ops.l2_prefetch(ws)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(ws, before))
    assert torch.equal(x @ ws[0].T, ref)
    with pytest.raises((ValueError, RuntimeError), match="at most 8"):
        ops.l2_prefetch([ws[0]] * 9)
    with pytest.raises((ValueError, RuntimeError), match="contiguous"):
        ops.l2_prefetch([ws[0].T])

"""CPU checks of minillm.ops.gemm_ops: the dispatch rules of the small-M GEMM kernel (which calls it may take,
the environment switch, the test switch) and that linear() is F.linear wherever the kernel does not run."""
import pytest
import torch
import torch.nn.functional as F

from minillm.ops import gemm_ops


@pytest.fixture(autouse=True)
def _auto_switch():
    gemm_ops.set_small_m_gemm(None)
    yield
    gemm_ops.set_small_m_gemm(None)


def _xw(m=8, n=128, k=256, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(m * 7 + n + k)
    return torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)


def test_supported_shape_has_no_reason():
    x, w = _xw()
    assert gemm_ops.unsupported_reason(x, w) is None
    assert gemm_ops.unsupported_reason(x, w, torch.zeros(128, dtype=torch.bfloat16)) is None
    assert gemm_ops.unsupported_reason(*_xw(dtype=torch.float16)) is None
    for m in (0, 1, gemm_ops.MAX_M):
        assert gemm_ops.unsupported_reason(*_xw(m=m)) is None, m


@pytest.mark.parametrize("case", ["fp32", "mixed_dtype", "bias_dtype", "k_not_64", "n_not_64", "k_mismatch",
                                  "m_too_big", "weight_transposed", "x_misaligned", "x_row_stride", "x_column_stride",
                                  "bias_shape", "x_3d_rows"])
def test_unsupported_shapes_have_a_reason(case):
    x, w = _xw()
    b = None
    if case == "fp32":
        x, w = x.float(), w.float()
    elif case == "mixed_dtype":
        w = w.half()
    elif case == "bias_dtype":
        b = torch.zeros(128)
    elif case == "k_not_64":
        x, w = _xw(k=96)
    elif case == "n_not_64":
        x, w = _xw(n=96)
    elif case == "k_mismatch":
        w = _xw(k=320)[1]
    elif case == "m_too_big":
        x = _xw(m=gemm_ops.MAX_M + 1)[0]
    elif case == "weight_transposed":
        w = torch.randn(256, 128).bfloat16().t()          # [128, 256] with strides (1, 128)
    elif case == "x_misaligned":
        x = torch.randn(8, 256 + 8).bfloat16()[:, 1:257]  # data pointer 2 bytes past an aligned address
    elif case == "x_row_stride":
        x = torch.randn(8, 256 + 4).bfloat16()[:, :256]   # rows 520 bytes apart: not 16-byte aligned
    elif case == "x_column_stride":
        x = torch.randn(256, 8).bfloat16().t()
    elif case == "bias_shape":
        b = torch.zeros(64, dtype=torch.bfloat16)
    elif case == "x_3d_rows":
        x = x.reshape(2, 4, 256)                          # unsupported_reason wants [M, K]; linear() reshapes
    assert gemm_ops.unsupported_reason(x, w, b) is not None


def test_strided_rows_are_supported():
    x = torch.randn(8, 256 + 64).bfloat16()[:, 64:]       # rows 640 bytes apart, start 128 bytes in
    assert gemm_ops.unsupported_reason(x, _xw()[1]) is None
    one = torch.randn(1, 512).bfloat16()[:, 256:]         # a single row: its row stride does not matter
    assert gemm_ops.unsupported_reason(one, _xw()[1]) is None


def test_never_on_cpu():
    x, w = _xw()
    assert not gemm_ops.supports(x, w)
    gemm_ops.set_small_m_gemm(True)                       # forcing the kernel on does not move CPU tensors to it
    assert not gemm_ops.supports(x, w)
    assert not gemm_ops.supports(x.reshape(2, 4, 256), w)


def test_environment_switch(monkeypatch):
    monkeypatch.delenv("MINILLM_SMALL_M_GEMM", raising=False)
    assert gemm_ops.env_enabled()
    monkeypatch.setenv("MINILLM_SMALL_M_GEMM", "0")
    assert not gemm_ops.env_enabled()
    monkeypatch.setenv("MINILLM_SMALL_M_GEMM", " 0 ")
    assert not gemm_ops.env_enabled()
    monkeypatch.setenv("MINILLM_SMALL_M_GEMM", "1")
    assert gemm_ops.env_enabled()


def test_test_switch_round_trip():
    gemm_ops.set_small_m_gemm(False)
    assert gemm_ops._switch.enabled is False
    gemm_ops.set_small_m_gemm(True)
    assert gemm_ops._switch.enabled is True
    gemm_ops.set_small_m_gemm(None)
    assert gemm_ops._switch.enabled is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(8, 256), (2, 3, 256), (256,), (0, 256), (300, 256)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_on_cpu_is_f_linear(dtype, shape, with_bias):
    g = torch.Generator().manual_seed(len(shape) * 10 + shape[0])
    x = torch.randn(*shape, generator=g).to(dtype)
    w = torch.randn(128, 256, generator=g).to(dtype)
    b = torch.randn(128, generator=g).to(dtype) if with_bias else None
    out = gemm_ops.linear(x, w, b)
    assert torch.equal(out, F.linear(x, w, b))
    assert out.shape == (*shape[:-1], 128)

"""GPU checks of the small-M GEMM kernel (torch.ops.minillm.small_m_linear, cuda/small_m_gemm.cu) against an fp32
torch reference: every decode shape of Qwen3-0.6B for M from 1 to 256, bf16 and fp16, with and without bias;
forced launch shapes (several token tiles, uneven and maximal K splits); bit-identical reruns; CUDA-graph
capture and replay; back-to-back dependent launches (programmatic dependent launch); the split-K counters left
at zero; the fallbacks of gemm_ops.linear. Outputs are NaN-poisoned first (the caching allocator hands the
poisoned blocks back to the op), so an element the kernel forgets to write shows. Skipped without CUDA."""
import pytest
import torch
import torch.nn.functional as F

from minillm.ops import gemm_ops

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
# Qwen3-0.6B decode GEMMs: (N, K) of y[M, N] = x[M, K] @ w[N, K]^T
SHAPES = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
LM_HEAD = (151936, 1024)
M_VALUES = [1, 7, 8, 16, 33, 64, 130, 200, 256]
# Max abs error allowed, relative to the largest reference output: the output is rounded once from fp32 (half
# an ulp: 2e-3 in bf16), and fp32 sums in another order move it by far less.
REL_TOL = 1e-2


@pytest.fixture(scope="module")
def ops():
    from minillm.ops.build import load_extension
    ext = load_extension()
    gemm_ops.set_small_m_gemm(True)
    yield ext
    gemm_ops.set_small_m_gemm(None)


_weights: dict = {}


def _weight(n, k, dtype, with_bias):
    """Weights ~ N(0, 1/K) like a trained layer (outputs ~ N(0, 1) for unit inputs), cached per shape."""
    key = (n, k, dtype)
    if key not in _weights:
        g = torch.Generator("cuda").manual_seed(n + k)
        w = (torch.randn(n, k, generator=g, device="cuda") / k ** 0.5).to(dtype)
        b = torch.randn(n, generator=g, device="cuda").to(dtype)
        _weights[key] = (w, b)
    w, b = _weights[key]
    return w, (b if with_bias else None)


def _x(m, k, dtype, seed=0):
    g = torch.Generator("cuda").manual_seed(seed * 1000 + m)
    return torch.randn(m, k, generator=g, device="cuda").to(dtype)


def _ref(x, w, b):
    y = x.float() @ w.float().T
    return y + b.float() if b is not None else y


def _poison(m, n, dtype):
    blocks = [torch.full((m, n), float("nan"), dtype=dtype, device="cuda") for _ in range(2)]
    del blocks


def _check(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == dtype
    assert not out.isnan().any(), "unwritten (NaN) elements in the kernel output"
    scale = max(ref.abs().max().item(), 1e-6)
    err = (out.float() - ref).abs().max().item()
    assert err <= REL_TOL * scale, f"max abs error {err:.3g} vs output scale {scale:.3g}"
    # Rounded once from fp32 like the reference: only the fp32 summation order may move a value by an ulp.
    same = (out == ref.to(dtype)).float().mean().item()
    assert same >= 0.95, f"only {same:.3f} of the outputs equal the rounded fp32 reference"


def _counters_clean(device="cuda"):
    torch.cuda.synchronize()
    assert int(gemm_ops.counters(torch.device(device)).abs().sum().item()) == 0, "split-K counters not reset"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("m", M_VALUES)
def test_decode_shapes(ops, m, name, with_bias, dtype):
    n, k = SHAPES[name]
    w, b = _weight(n, k, dtype, with_bias)
    x = _x(m, k, dtype)
    _poison(m, n, dtype)
    out = gemm_ops.small_m_linear(x, w, b)
    _check(out, _ref(x, w, b), dtype)
    _counters_clean()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 33, 130, 256])
def test_lm_head(ops, m, dtype):
    n, k = LM_HEAD
    w, _ = _weight(n, k, dtype, False)
    x = _x(m, k, dtype)
    _poison(m, n, dtype)
    _check(gemm_ops.small_m_linear(x, w), _ref(x, w, None), dtype)


# (M, N, K, tile_m, split_k): several token tiles (the last one partial), uneven K slices, the largest split,
# a split of one k-step per CTA, more weight stages than the ring holds.
FORCED = [(200, 1024, 2048, 64, 3), (200, 1024, 2048, 128, 0), (130, 1024, 2048, 256, 16), (7, 1024, 1024, 64, 1),
          (256, 4096, 1024, 128, 5), (64, 1024, 3072, 256, 2), (70, 2048, 1024, 64, 16), (1, 64, 64, 64, 1),
          (17, 128, 960, 0, 1), (256, 64, 1024, 64, 7)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,tile_m,split_k", FORCED)
def test_forced_launch_shapes(ops, m, n, k, tile_m, split_k, dtype):
    w, b = _weight(n, k, dtype, True)
    x = _x(m, k, dtype, seed=1)
    _poison(m, n, dtype)
    _check(gemm_ops.small_m_linear(x, w, b, tile_m=tile_m, split_k=split_k), _ref(x, w, b), dtype)
    _counters_clean()


@pytest.mark.parametrize("name", ["o_proj", "down", "qkv", "gate_up"])
@pytest.mark.parametrize("m", [1, 130, 256])
def test_deterministic(ops, name, m):
    n, k = SHAPES[name]
    w, b = _weight(n, k, torch.bfloat16, True)
    x = _x(m, k, torch.bfloat16, seed=2)
    first = gemm_ops.small_m_linear(x, w, b)
    for _ in range(3):
        assert torch.equal(gemm_ops.small_m_linear(x, w, b), first)


def test_strided_and_batched_inputs(ops):
    n, k = SHAPES["qkv"]
    w, b = _weight(n, k, torch.bfloat16, True)
    wide = _x(40, k + 128, torch.bfloat16, seed=3)
    x = wide[:, 64:64 + k]                                     # row stride k + 128, starts 128 bytes in
    assert gemm_ops.supports(x, w, b)
    _check(gemm_ops.linear(x, w, b), _ref(x, w, b), torch.bfloat16)
    x3 = _x(24, k, torch.bfloat16, seed=4).reshape(2, 12, k)   # [..., K] input
    out = gemm_ops.linear(x3, w, b)
    assert out.shape == (2, 12, n)
    _check(out.reshape(24, n), _ref(x3.reshape(24, k), w, b), torch.bfloat16)


def test_empty_input(ops):
    n, k = SHAPES["o_proj"]
    w, _ = _weight(n, k, torch.bfloat16, False)
    out = gemm_ops.small_m_linear(torch.empty(0, k, dtype=torch.bfloat16, device="cuda"), w)
    assert out.shape == (0, n)


def test_fallbacks_use_f_linear(ops):
    n, k = SHAPES["o_proj"]
    w, b = _weight(n, k, torch.bfloat16, True)
    big = _x(gemm_ops.MAX_M + 1, k, torch.bfloat16)
    assert not gemm_ops.supports(big, w, b)
    assert torch.equal(gemm_ops.linear(big, w, b), F.linear(big, w, b))
    x32, w32 = _x(8, k, torch.float32), w.float()
    assert not gemm_ops.supports(x32, w32)
    assert torch.equal(gemm_ops.linear(x32, w32), F.linear(x32, w32))
    odd_w = w[:, :96].contiguous()
    assert not gemm_ops.supports(_x(8, 96, torch.bfloat16), odd_w)


def test_switches(ops, monkeypatch):
    n, k = SHAPES["qkv"]
    w, _ = _weight(n, k, torch.bfloat16, False)
    x = _x(8, k, torch.bfloat16)
    assert gemm_ops.supports(x, w)
    gemm_ops.set_small_m_gemm(False)
    assert not gemm_ops.supports(x, w)
    gemm_ops.set_small_m_gemm(None)
    monkeypatch.setenv("MINILLM_SMALL_M_GEMM", "0")
    assert not gemm_ops.supports(x, w)
    monkeypatch.setenv("MINILLM_SMALL_M_GEMM", "1")
    assert gemm_ops.supports(x, w)
    gemm_ops.set_small_m_gemm(True)


@pytest.mark.parametrize("case", ["k_not_64", "n_not_64", "m_too_big", "fp32", "bias_shape", "counters_dtype",
                                  "tile_m", "split_k"])
def test_bad_input_raises_value_error(ops, case):
    k, n = 256, 128
    x, w, b = _x(8, k, torch.bfloat16), _weight(n, k, torch.bfloat16, True)[0], None
    cnt = gemm_ops.counters("cuda")
    kw = {}
    if case == "k_not_64":
        x, w = _x(8, 96, torch.bfloat16), torch.zeros(n, 96, dtype=torch.bfloat16, device="cuda")
    elif case == "n_not_64":
        w = torch.zeros(96, k, dtype=torch.bfloat16, device="cuda")
    elif case == "m_too_big":
        x = _x(gemm_ops.MAX_M + 1, k, torch.bfloat16)
    elif case == "fp32":
        x, w = x.float(), w.float()
    elif case == "bias_shape":
        b = torch.zeros(n + 64, dtype=torch.bfloat16, device="cuda")
    elif case == "counters_dtype":
        cnt = torch.zeros(16, dtype=torch.int64, device="cuda")
    elif case == "tile_m":
        kw = {"tile_m": 32}
    elif case == "split_k":
        kw = {"split_k": 17}
    with pytest.raises(ValueError):
        ops.small_m_linear(x, w, b, cnt, kw.get("tile_m", 0), kw.get("split_k", 0))


def test_plan_is_consistent(ops):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n, k in list(SHAPES.values()) + [LM_HEAD]:
        for m in (1, 8, 64, 130, 256):
            p = gemm_ops.plan(m, n, k, sms)
            assert p["grid_x"] == n // 64 and p["grid_y"] == -(-m // p["tile_m"]) and p["grid_z"] == p["split_k"]
            assert 1 <= p["split_k"] <= min(16, k // 64) and p["tile_m"] in (64, 128, 256)
            assert (p["workspace_floats"] > 0) == (p["split_k"] > 1)


@pytest.mark.parametrize("name", ["o_proj", "gate_up"])   # split-K (workspace + counters) and no split
def test_cuda_graph_capture_and_replay(ops, name):
    n, k = SHAPES[name]
    w, b = _weight(n, k, torch.bfloat16, True)
    x = _x(130, k, torch.bfloat16, seed=5)
    eager = gemm_ops.linear(x, w, b)                       # also allocates the counters outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemm_ops.linear(x, w, b)                           # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemm_ops.linear(x, w, b)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager)
    x.copy_(_x(130, k, torch.bfloat16, seed=6))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, gemm_ops.linear(x, w, b))
    _counters_clean()


def _chain(weights, x):
    """Each GEMM consumes a slice of the previous one's output (dependent, back-to-back launches)."""
    outs, h = [], x
    for w in weights:
        h = gemm_ops.linear(h[:, :w.shape[1]], w)
        outs.append(h)
    return outs


@pytest.mark.parametrize("m", [8, 130])
def test_dependent_chain(ops, m):
    """With programmatic dependent launch each kernel starts before the previous one ends; it must still read
    the previous output only once complete. Each step is checked against the reference of its own input."""
    dtype = torch.bfloat16
    shapes = [SHAPES["qkv"], SHAPES["o_proj"], SHAPES["gate_up"], SHAPES["down"]] * 3
    weights = [_weight(n, k, dtype, False)[0] for n, k in shapes]
    x = _x(m, 1024, dtype, seed=7)

    def verify(outs):
        prev = x
        for w, out in zip(weights, outs):
            _check(out, _ref(prev[:, :w.shape[1]], w, None), dtype)
            prev = out

    verify(_chain(weights, x))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _chain(weights, x)
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    verify(outs)
    _counters_clean()

"""The fused MoE kernels (cuda/moe_routing.cu, cuda/moe_gemm.cu): their torch twins against the references, the
coverage declaration against the C++ launchers, the execution plan's moe verdict, and on a GPU the kernels against
their twins (zero-token experts, every token on one expert, NaN-poisoned buffers and untouched experts, CUDA-graph
replays under new routing)."""
import dataclasses
import math
import re

import pytest
import torch
import torch.nn.functional as F

from minillm.diagnostics.moe_check import router_logits
from minillm.model.loader import resolve_arch
from minillm.ops import build, moe_ops
from minillm.ops.build import CUDA_DIR
from test_plan import A100, CPU, H200, plan


def _src(name: str) -> str:
    return (CUDA_DIR / name).read_text()


# ---- torch twins (CPU) ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("t,e,k", [(37, 8, 1), (37, 16, 4), (5, 128, 8), (64, 512, 8), (3, 4, 4)])
def test_route_twin_is_route_without_ties(t, e, k, renormalize):
    logits = router_logits(t, e, e + k, None)
    want, got = moe_ops.route(logits, k, renormalize, weight_dtype=torch.float32), \
        moe_ops.route_twin(logits, k, renormalize)
    assert torch.equal(got.experts.long(), want.experts) and torch.equal(got.order.long(), want.order)
    assert torch.equal(got.counts, want.counts) and torch.equal(got.offsets, want.offsets)
    torch.testing.assert_close(got.weights, want.weights, rtol=1e-6, atol=1e-7)
    n = int(got.active[e])
    assert n == int((want.counts > 0).sum())
    assert got.active[:n].tolist() == torch.nonzero(want.counts).flatten().tolist()


def test_route_twin_breaks_ties_by_lower_index():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0], [0.0] * 5])
    r = moe_ops.route_twin(logits, 3, True)
    assert r.experts.tolist() == [[1, 2, 4], [0, 1, 2]]
    torch.testing.assert_close(r.weights, torch.full((2, 3), 1 / 3))


@pytest.mark.parametrize("rule", [None, "one"])
def test_experts_twin_matches_the_float64_reference(rule):
    t, e, k, h, i = 13, 8, 2, 64, 32
    g = torch.Generator().manual_seed(3)
    x, router = torch.randn(t, h, generator=g), torch.randn(e, h, generator=g)
    if rule == "one":
        x, router[5] = x.abs(), 10.0
    w13, w2 = 0.2 * torch.randn(e, 2 * i, h, generator=g), 0.2 * torch.randn(e, h, i, generator=g)
    r = moe_ops.route_twin(F.linear(x, router), k, True)
    if rule == "one":
        assert r.counts[5] == t
    act, pairs, out = moe_ops.experts_twin(x, w13, w2, r)
    assert act.shape == (t * k, i) and pairs.shape == (t * k, h)
    torch.testing.assert_close(out.double(), moe_ops.moe_reference(x, router, w13, w2, k, True), atol=1e-5, rtol=1e-5)


def test_active_experts_lists_ids_then_their_number():
    assert moe_ops.active_experts(torch.tensor([0, 3, 0, 1, 2], dtype=torch.int32)).tolist() == [1, 3, 4, 0, 0, 3]


def test_fused_shape_reason_names_the_size():
    assert moe_ops.fused_shape_reason(128, 8, 2048, 768) is None
    assert moe_ops.fused_shape_reason(16, 4, 256, 128) is None
    assert "num_experts=513" in moe_ops.fused_shape_reason(513, 8, 2048, 768)
    assert "num_experts_per_tok=9" in moe_ops.fused_shape_reason(128, 9, 2048, 768)
    assert "hidden_size=64" in moe_ops.fused_shape_reason(8, 2, 64, 128)
    assert "moe_intermediate_size=48" in moe_ops.fused_shape_reason(8, 2, 256, 48)


# ---- the declaration against the launchers (CPU) --------------------------------------------------------------

def test_fused_declaration_matches_the_launchers():
    h, route_cu, gemm_cu = _src("moe.h"), _src("moe_routing.cu"), _src("moe_gemm.cu")
    bindings = _src("moe_bindings.cpp")
    consts = {m[0]: int(m[1]) for m in re.findall(r"constexpr int (kMoe\w+) = (\d+);", h)}
    assert consts == {"kMoeMaxExperts": moe_ops.MAX_EXPERTS, "kMoeMaxTopK": moe_ops.MAX_TOP_K,
                      "kMoeTileK": moe_ops.TILE_K, "kMoeKWarps": moe_ops.K_WARPS, "kMoeGateCols": moe_ops.GATE_COLS,
                      "kMoeDownCols": moe_ops.DOWN_COLS, "kMoeRouteGemvTokens": moe_ops.ROUTE_GEMV_TOKENS,
                      "kMoeDownCombineCols": moe_ops.DOWN_COMBINE_COLS}
    # the launchers refuse exactly the sizes fused_shape_reason names
    assert "E > kMoeMaxExperts || k < 1 || k > kMoeMaxTopK || k > E" in route_cu
    assert "H % kMoeTileK || H / kMoeTileK < kMoeKWarps || I % kMoeGateCols" in gemm_cu
    assert "I % kMoeTileK || I / kMoeTileK < kMoeKWarps || H % kMoeDownCols" in gemm_cu
    # the small-step variants: route_gemv refuses more than its tokens, down_combine needs less than moe_down
    assert "route_refused(T, E, k) || T > kMoeRouteGemvTokens" in route_cu
    assert "I % 8 || H % kDcCols" in gemm_cu and "kDcCols = kMoeDownCombineCols" in gemm_cu
    assert moe_ops.DOWN_COLS % moe_ops.DOWN_COMBINE_COLS == 0 and moe_ops.TILE_K % 8 == 0
    # dtypes: bf16 and fp16 experts, fp32 logits
    assert "t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf" in bindings
    assert set(moe_ops.FUSED_COVERAGE.dtypes) == {"bfloat16", "float16"}
    assert "logits_in.scalar_type() == at::kFloat" in bindings
    assert "router.scalar_type() == at::kFloat" in bindings   # route_gemv: bf16 / fp16 x (expert_dtype), fp32 router
    # sm_80 floor: mma.sync and cache hints, no sm_90-only body
    for src in (route_cu, gemm_cu):
        assert "__CUDA_ARCH__ >= 900" not in src
    assert "mma16816" in gemm_cu and moe_ops.FUSED_COVERAGE.min_capability == (8, 0)
    assert moe_ops.FUSED_COVERAGE.max_major is None and moe_ops.FUSED_COVERAGE.graph_safe


def test_every_moe_kernel_waits_for_its_predecessor_first():
    """PDL discipline (cuda/launch.h): each kernel launched through launch_kernel() calls pdl_enter() before it
    reads or writes global memory (the routing kernels clear shared memory first)."""
    for name in ("moe_routing.cu", "moe_gemm.cu"):
        src = _src(name)
        kernels = re.findall(r"__global__ void[^{]*?(moe_\w+_kernel)\([^{]*\{(.*?)\n\}", src, re.S)
        assert kernels
        for kernel, body in kernels:
            lines = [ln.strip() for ln in body.splitlines() if ln.strip() and not ln.strip().startswith("//")]
            first = next(i for i, ln in enumerate(lines) if "pdl_enter();" in ln)
            assert all(ln.startswith(("__shared__", "extern __shared__", "constexpr", "clear_counts("))
                       for ln in lines[:first]), kernel


def test_the_build_compiles_the_moe_sources():
    from minillm.ops.build import extension_sources
    names = {p.name for p in extension_sources()}
    assert {"moe_routing.cu", "moe_gemm.cu", "moe_bindings.cpp"} <= names


# ---- the execution plan (CPU, made-up GPUs) -------------------------------------------------------------------

MOE = "qwen3-30b-a3b"


@pytest.fixture
def fake_extension(monkeypatch):
    """The CUDA extension 'loads' (nothing is built): the plan's logic is what is tested."""
    monkeypatch.setattr(build, "load_extension", lambda: object())


@pytest.mark.usefixtures("fake_extension")
def test_30b_a3b_on_an_h200_takes_the_fused_kernels_under_graphs():
    p = plan(MOE, max_num_seqs=64)
    assert p.moe.on and p.moe.max_rows == moe_ops.FUSED_MAX_TOKENS and p.cuda_graphs.on
    assert p.model_kernels().moe_rows == moe_ops.FUSED_MAX_TOKENS
    assert p.record()["plan"]["moe"] == {"on": True, "reason": p.moe.reason, "max_rows": p.moe.max_rows}
    assert f"moe<={p.moe.max_rows}" in p.describe()


@pytest.mark.usefixtures("fake_extension")
def test_fp16_keeps_graphs_only_while_the_fused_kernels_take_every_captured_step():
    assert plan(MOE, dtype="float16").cuda_graphs.on        # grouped_mm needs bf16; the fused kernels take fp16
    big = plan(MOE, dtype="float16", max_num_seqs=moe_ops.FUSED_MAX_TOKENS + 1)
    assert big.moe.on and not big.cuda_graphs.on and "float16" in big.cuda_graphs.reason
    off = plan(MOE, dtype="float16", moe_kernels=False)
    assert not off.moe.on and off.moe.reason == "kernels.moe=false" and off.model_kernels().moe_rows == 0
    assert not off.cuda_graphs.on and "host" in off.cuda_graphs.reason
    assert plan(MOE, moe_kernels=False).cuda_graphs.on       # bf16: grouped_mm is graph-safe by itself


@pytest.mark.usefixtures("fake_extension")
@pytest.mark.parametrize("kw,device,words", [
    (dict(dtype="float32"), H200, "dtype float32"),
    (dict(kernels="torch"), H200, "kernels.backend=torch"),
    ({}, CPU, "runs on cpu"),
])
def test_the_moe_verdict_says_why_it_is_off(kw, device, words):
    p = plan(MOE, device=device, **kw)
    assert not p.moe.on and words in p.moe.reason and p.model_kernels().moe_rows == 0


@pytest.mark.usefixtures("fake_extension")
def test_an_a100_takes_the_fused_kernels_and_a_dense_model_has_none():
    assert plan(MOE, device=A100).moe.on
    dense = plan("qwen3-0.6b")
    assert not dense.moe.on and "no mixture-of-experts" in dense.moe.reason


@pytest.mark.usefixtures("fake_extension")
def test_a_shape_the_kernels_refuse_stays_on_torch():
    odd = dataclasses.replace(resolve_arch(MOE), moe_intermediate_size=48)
    p = plan(MOE, arch=odd)
    assert not p.moe.on and "moe_intermediate_size=48" in p.moe.reason


# ---- the kernels on a GPU ---------------------------------------------------------------------------------------

def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from minillm.ops.build import load_extension
    load_extension()
    reason = moe_ops.FUSED_COVERAGE.reason(dtype="bfloat16", capability=torch.cuda.get_device_capability())
    if reason:
        pytest.skip(reason)
    return torch.device("cuda")


ROUTE_CASES = [(1, 128, 8, None), (7, 8, 1, None), (64, 128, 8, None), (256, 128, 8, None), (33, 512, 8, None),
               (40, 60, 3, None), (19, 16, 4, "one"), (30, 16, 4, "ties"), (0, 16, 2, None), (1100, 64, 2, None)]


@pytest.mark.gpu
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("t,e,k,rule", ROUTE_CASES)
def test_routing_kernel_matches_its_twin(t, e, k, rule, renormalize):
    dev = _gpu()
    logits = router_logits(t, e, t + e, rule, dev)
    got, want = moe_ops.route_fused(logits, k, renormalize), moe_ops.route_twin(logits, k, renormalize)
    assert got.experts.dtype == got.order.dtype == got.active.dtype == torch.int32
    assert got.weights.dtype == torch.float32
    assert torch.equal(got.experts, want.experts), "top-k ids (ties: lower index first)"
    assert torch.equal(got.counts, want.counts) and torch.equal(got.offsets, want.offsets)
    assert torch.equal(got.order, want.order), "stable expert order"
    n = int(want.active[e])
    assert int(got.active[e]) == n and torch.equal(got.active[:n], want.active[:n])
    torch.testing.assert_close(got.weights, want.weights, rtol=2e-6, atol=1e-7)


SHAPES = [  # tokens, experts, top_k, hidden, intermediate, routing rule
    (1, 128, 8, 2048, 768, None), (8, 128, 8, 2048, 768, None), (13, 16, 4, 256, 128, None),
    (64, 128, 8, 2048, 768, None), (200, 16, 4, 256, 128, None), (40, 16, 2, 256, 128, "one"),
    (3, 64, 1, 512, 256, None), (5, 16, 2, 128, 128, None),   # the last: gate_up with two row warps at T <= 8
    (256, 16, 4, 1024, 512, None)]   # 512 gate_up and down tiles, ~64 rows an expert, in passes


def _experts(e, h, i, dt, dev, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    return (0.05 * torch.randn(e, 2 * i, h, generator=g, device=dev)).to(dt), \
        (0.05 * torch.randn(e, h, i, generator=g, device=dev)).to(dt)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,e,k,h,i,rule", SHAPES)
def test_expert_kernels_match_their_twin_and_read_only_touched_experts(t, e, k, h, i, rule, dtype):
    dev = _gpu()
    w13, w2 = _experts(e, h, i, dtype, dev, t + e)
    x = torch.randn(t, h, device=dev).to(dtype)
    r = moe_ops.route_fused(router_logits(t, e, t, rule, dev), k, True)
    untouched = r.counts == 0
    w13[untouched], w2[untouched] = float("nan"), float("nan")   # never to be read
    n = t * k
    act = torch.full((n, i), float("nan"), dtype=dtype, device=dev)
    pairs = torch.full((n, h), float("nan"), device=dev)
    out = torch.full((t, h), float("nan"), dtype=dtype, device=dev)
    moe_ops.fused_experts(x, w13, w2, r, act=act, pairs=pairs, out=out)
    want_act, want_pairs, want = moe_ops.experts_twin(x, w13, w2, r)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=4e-3, rtol=4e-3)
    torch.testing.assert_close(act.float(), want_act, **tol)
    torch.testing.assert_close(pairs, want_pairs, **tol)
    torch.testing.assert_close(out.float(), want, **tol)
    # and the whole layer against the float64 token-by-token reference of the torch path
    assert torch.isfinite(out).all()


@pytest.mark.gpu
def test_fused_layer_is_as_close_to_float64_as_the_grouped_mm_path():
    """The Qwen3-30B-A3B layer shape at 64 tokens: the fused kernels' output is no further from a float64
    computation (of the same routing) than the torch._grouped_mm path's, which rounds the SwiGLU output, each
    expert's output and the routing weights to bf16 where the fused path keeps fp32 (so the two differ by
    more than bf16 rounding in a few elements, and comparing them to each other says little)."""
    dev = _gpu()
    if moe_ops.grouped_mm_unsupported_reason(dev, torch.bfloat16, 2048, 768) is not None:
        pytest.skip(moe_ops.grouped_mm_unsupported_reason(dev, torch.bfloat16, 2048, 768))
    t, e, k, h, i = 64, 128, 8, 2048, 768
    w13, w2 = _experts(e, h, i, torch.bfloat16, dev, 1)
    x = torch.randn(t, h, device=dev).to(torch.bfloat16)
    logits = router_logits(t, e, 9, None, dev)
    fused_routing = moe_ops.route_fused(logits, k, True)
    torch_routing = moe_ops.route(logits, k, True, weight_dtype=x.dtype)
    fused = moe_ops.fused_experts(x, w13, w2, fused_routing)
    torch_path = moe_ops.grouped_experts(x, w13, w2, torch_routing)

    def float64_layer(routing):
        xd, out = x.double(), torch.zeros(t, h, dtype=torch.float64, device=dev)
        for slot in range(k):
            for ex in routing.experts[:, slot].unique().tolist():
                rows = (routing.experts[:, slot] == ex).nonzero().view(-1)
                gate, up = F.linear(xd[rows], w13[ex].double()).chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, w2[ex].double())
                out[rows] += routing.weights[rows, slot].double().unsqueeze(-1) * y
        return out

    err_fused = (fused.double() - float64_layer(fused_routing)).abs().max().item()
    err_torch = (torch_path.double() - float64_layer(torch_routing)).abs().max().item()
    assert math.isfinite(err_fused) and err_fused <= 1.25 * err_torch + 1e-3, (err_fused, err_torch)


@pytest.mark.gpu
def test_fused_path_replays_under_a_cuda_graph_with_new_routing():
    """Captured once, replayed with logits that route differently (other counts, empty experts, everything on k
    experts): each replay equals the eager result bit for bit (no count baked in, no atomics in the sums)."""
    dev = _gpu()
    t, e, k, h, i = 48, 32, 4, 256, 128
    w13, w2 = _experts(e, h, i, torch.bfloat16, dev, 2)
    x = torch.randn(t, h, device=dev).to(torch.bfloat16)
    logits = torch.randn(t, e, device=dev)

    def step():
        return moe_ops.fused_experts(x, w13, w2, moe_ops.route_fused(logits, k, True))

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    g = torch.Generator(device=dev).manual_seed(5)
    for trial in range(4):
        new = 2.0 * torch.randn(t, e, generator=g, device=dev)
        if trial == 3:
            new[:, :k] += 100.0
        logits.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step())
        _, _, want = moe_ops.experts_twin(x, w13, w2, moe_ops.route_twin(logits, k, True))
        torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_the_bindings_refuse_bad_tensors_naming_them():
    dev = _gpu()
    with pytest.raises(ValueError, match="logits must be a CUDA float32"):
        torch.ops.minillm.moe_route(torch.zeros(2, 8, device=dev, dtype=torch.bfloat16), 2, True)
    with pytest.raises(ValueError, match="top_k must be in"):
        torch.ops.minillm.moe_route(torch.zeros(2, 8, device=dev), 9, True)
    r = moe_ops.route_fused(torch.zeros(2, 8, device=dev), 2, True)
    w13, w2 = _experts(8, 256, 48, torch.bfloat16, dev, 0)
    with pytest.raises(ValueError, match="intermediate must be a multiple"):
        moe_ops.fused_experts(torch.zeros(2, 256, device=dev, dtype=torch.bfloat16), w13, w2, r)


# ---- the small-step variants: the decision (CPU) ---------------------------------------------------------------

def test_moe_variant_takes_each_variant_up_to_its_constant_and_within_the_kernels_limits():
    assert 1 <= moe_ops.ROUTE_GEMV_MAX_TOKENS <= moe_ops.ROUTE_GEMV_TOKENS
    assert moe_ops.DOWN_COMBINE_MAX_TOKENS <= moe_ops.FUSED_MAX_TOKENS
    for t in range(0, 2 * moe_ops.ROUTE_GEMV_TOKENS + 2):
        v = moe_ops.moe_variant(t)
        assert v.route_gemv == (t <= moe_ops.ROUTE_GEMV_MAX_TOKENS), t
        assert v.down_combine == (t <= moe_ops.DOWN_COMBINE_MAX_TOKENS), t
    assert moe_ops.moe_variant(1) == moe_ops.MoeVariant(route_gemv=True, down_combine=True)
    assert moe_ops.moe_variant(moe_ops.FUSED_MAX_TOKENS) == moe_ops.MoeVariant(False, False)


@pytest.fixture
def recorded_fused_ops(monkeypatch):
    """moe_ops' fused kernels replaced by recorders (CPU): which ones fused_moe calls, with what."""
    calls = []
    routing = moe_ops.Routing(*(torch.zeros(1) for _ in range(5)))

    def route_gemv(x, w, k, renormalize):
        calls.append(("route_gemv", x.shape[0], k, renormalize))
        return routing, torch.zeros(x.shape[0], w.shape[0])

    def route_fused(logits, k, renormalize):
        calls.append(("route_fused", tuple(logits.shape), logits.dtype))
        return routing

    def fused_experts(x, w13, w2, r, down_combine=False):
        assert r is routing
        calls.append(("fused_experts", x.shape[0], down_combine))
        return x

    monkeypatch.setattr(moe_ops, "route_gemv", route_gemv)
    monkeypatch.setattr(moe_ops, "route_fused", route_fused)
    monkeypatch.setattr(moe_ops, "fused_experts", fused_experts)
    return calls


@pytest.mark.parametrize("t", [1, moe_ops.DOWN_COMBINE_MAX_TOKENS, moe_ops.DOWN_COMBINE_MAX_TOKENS + 1,
                               moe_ops.ROUTE_GEMV_MAX_TOKENS, moe_ops.ROUTE_GEMV_MAX_TOKENS + 1, 64])
def test_fused_moe_takes_the_variants_moe_variant_picks(t, recorded_fused_ops):
    e, h = 16, 64
    x, w = torch.randn(t, h), torch.randn(e, h)
    moe_ops.fused_moe(x, w, None, None, 4, True)
    v = moe_ops.moe_variant(t)
    route = ("route_gemv", t, 4, True) if v.route_gemv else ("route_fused", (t, e), torch.float32)
    assert recorded_fused_ops == [route, ("fused_experts", t, v.down_combine)]


def test_the_moe_block_routes_fused_steps_through_fused_moe(monkeypatch):
    from minillm.model.arch import ModelArchConfig
    from minillm.model.qwen3_moe import SparseMoeBlock
    from minillm.ops.choice import ModelKernels
    arch = ModelArchConfig.from_hf_dict({
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2})
    block = SparseMoeBlock(arch, ModelKernels(moe_rows=4), dtype=torch.float32, device="cpu")
    calls = []

    def fused_moe(x, router_weight, w13, w2, top_k, renormalize):
        assert router_weight is block.gate.weight and w13 is block.experts.gate_up_proj
        assert w2 is block.experts.down_proj and (top_k, renormalize) == (2, arch.norm_topk_prob)
        calls.append(x.shape[0])
        return x

    monkeypatch.setattr(moe_ops, "fused_moe", fused_moe)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.1)
        for t in (1, 4, 5):   # 5: past moe_rows, the torch path
            block(torch.randn(t, 64))
    assert calls == [1, 4]


# ---- the small-step variants on a GPU ---------------------------------------------------------------------------

def _route_inputs(t, e, h, rule, dtype, dev, seed):
    from minillm.diagnostics.moe_check import router_inputs
    return router_inputs(t, e, h, seed, rule, dtype, dev)


def _assert_same_routing(got, want):
    e = want.counts.shape[0]
    assert got.experts.dtype == got.order.dtype == got.active.dtype == torch.int32
    assert torch.equal(got.experts, want.experts), "top-k ids (ties: lower index first)"
    assert torch.equal(got.counts, want.counts) and torch.equal(got.offsets, want.offsets)
    assert torch.equal(got.order, want.order), "stable expert order"
    n = int(want.active[e])
    assert int(got.active[e]) == n and torch.equal(got.active[:n], want.active[:n])
    torch.testing.assert_close(got.weights, want.weights.float(), rtol=2e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("k", [1, 8])
@pytest.mark.parametrize("e", [8, 128])
@pytest.mark.parametrize("t", [1, 2, 7, 16])
def test_route_gemv_on_exact_sums_equals_the_twin_of_torch_logits(t, e, k, renormalize):
    """x in {-1, 0, 1}, weights in quarters: every logit is exact in fp32 whatever the order of its sums, so the
    kernel's logits equal F.linear(x.float(), W) bit for bit and every output equals route_twin of them, ties
    included (equal router rows)."""
    dev = _gpu()
    x, w = _route_inputs(t, e, 2048, "exact", torch.bfloat16, dev, t * e + k)
    ref = F.linear(x.float(), w)
    assert (ref[:, 0] == ref[:, 1]).all()
    got, logits = moe_ops.route_gemv(x, w, k, renormalize)
    assert logits.dtype == torch.float32 and torch.equal(logits, ref)
    _assert_same_routing(got, moe_ops.route_twin(ref, k, renormalize))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [1, 8])
@pytest.mark.parametrize("e", [8, 128])
@pytest.mark.parametrize("t", [1, 2, 7, 16])
def test_route_gemv_matches_the_twin_on_random_inputs(t, e, k, dtype):
    """Random x and W: the logits are F.linear's within fp32 summation-order noise, and the routing is route_twin
    of the logits the kernel chose on (a near-tie could go either way between two summation orders)."""
    dev = _gpu()
    x, w = _route_inputs(t, e, 2048, None, dtype, dev, t + e + k)
    got, logits = moe_ops.route_gemv(x, w, k, True)
    ref = F.linear(x.float(), w)
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    _assert_same_routing(got, moe_ops.route_twin(logits, k, True))
    again, logits_again = moe_ops.route_gemv(x, w, k, True)
    assert torch.equal(logits_again, logits) and torch.equal(again.order, got.order)   # deterministic
    assert int(moe_ops.route_counter(dev)) == 0


@pytest.mark.gpu
def test_route_gemv_takes_strided_rows_no_tokens_and_many_experts():
    dev = _gpu()
    x, w = _route_inputs(4, 512, 1024, None, torch.bfloat16, dev, 3)
    wide = torch.zeros(4, 1024 + 64, dtype=torch.bfloat16, device=dev)
    wide[:, :1024] = x
    got, logits = moe_ops.route_gemv(wide[:, :1024], w, 8, True)   # row stride 1088 elements
    torch.testing.assert_close(logits, F.linear(x.float(), w), rtol=1e-5, atol=1e-4)
    _assert_same_routing(got, moe_ops.route_twin(logits, 8, True))
    none, _ = moe_ops.route_gemv(x[:0], w[:16], 2, True)
    assert none.counts.tolist() == [0] * 16 and none.offsets.tolist() == [0] * 17 and int(none.active[16]) == 0


@pytest.mark.gpu
def test_route_gemv_refuses_bad_tensors_naming_them():
    dev = _gpu()
    x, w = _route_inputs(2, 8, 256, None, torch.bfloat16, dev, 0)
    counter = moe_ops.route_counter(dev)
    ops = torch.ops.minillm
    with pytest.raises(ValueError, match="x: tokens must be at most"):
        ops.moe_route_gemv(x.new_zeros(moe_ops.ROUTE_GEMV_TOKENS + 1, 256), w, 2, True, counter)
    with pytest.raises(ValueError, match="x: dtype must be bfloat16 or float16"):
        ops.moe_route_gemv(x.float(), w, 2, True, counter)
    with pytest.raises(ValueError, match="router must be a contiguous"):
        ops.moe_route_gemv(x, w.to(torch.bfloat16), 2, True, counter)
    with pytest.raises(ValueError, match="top_k must be in"):
        ops.moe_route_gemv(x, w, 9, True, counter)
    with pytest.raises(ValueError, match="counter must be a contiguous int32"):
        ops.moe_route_gemv(x, w, 2, True, counter.float())


COMBINE_SHAPES = [  # tokens, experts, top_k, hidden, intermediate, routing rule
    (1, 128, 8, 2048, 768, None), (2, 128, 8, 2048, 768, None), (8, 128, 8, 2048, 768, None),
    (16, 128, 8, 2048, 768, None), (5, 16, 4, 256, 128, None), (3, 64, 1, 512, 256, None),
    (6, 8, 8, 256, 160, None), (12, 16, 2, 256, 128, "one"), (24, 128, 8, 2048, 768, None)]   # k = E, I not a multiple of 256; one expert


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,e,k,h,i,rule", COMBINE_SHAPES)
def test_down_combine_matches_the_twin_and_the_launch_chain(t, e, k, h, i, rule, dtype):
    """out = the twin's pairs summed over the slots; within fp32 summation-order noise of the down + combine
    chain (both end in one rounding to the activation dtype); bit for bit the same run to run; untouched experts
    (NaN weights) never read."""
    dev = _gpu()
    w13, w2 = _experts(e, h, i, dtype, dev, t + e)
    x = torch.randn(t, h, device=dev).to(dtype)
    r = moe_ops.route_fused(router_logits(t, e, t, rule, dev), k, True)
    untouched = r.counts == 0
    w13[untouched], w2[untouched] = float("nan"), float("nan")
    out = torch.full((t, h), float("nan"), dtype=dtype, device=dev)
    moe_ops.fused_experts(x, w13, w2, r, out=out, down_combine=True)
    _, _, want = moe_ops.experts_twin(x, w13, w2, r)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=4e-3, rtol=4e-3)
    torch.testing.assert_close(out.float(), want, **tol)
    chain = moe_ops.fused_experts(x, w13, w2, r).float()
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)   # the most one rounding step is, relative to the value
    noise = 1e-5 * float(want.abs().max())                  # fp32 sums in another order
    assert ((out.float() - chain).abs() <= ulp * torch.maximum(out.float().abs(), chain.abs()) + noise).all()
    assert torch.equal(out, moe_ops.fused_experts(x, w13, w2, r, down_combine=True))


@pytest.mark.gpu
def test_down_combine_refuses_bad_tensors_naming_them():
    dev = _gpu()
    r = moe_ops.route_fused(torch.zeros(2, 8, device=dev), 2, True)
    w13, w2 = _experts(8, 256, 128, torch.bfloat16, dev, 0)
    act = torch.zeros(4, 128, dtype=torch.bfloat16, device=dev)
    out = torch.zeros(2, 256, dtype=torch.bfloat16, device=dev)
    ops = torch.ops.minillm
    with pytest.raises(ValueError, match="ids must be a contiguous int32"):
        ops.moe_down_combine(act, w2, r.experts.long(), r.weights, r.order, 2, out)
    with pytest.raises(ValueError, match="weights must be a contiguous float32"):
        ops.moe_down_combine(act, w2, r.experts, r.weights.half(), r.order, 2, out)
    with pytest.raises(ValueError, match="out must be a"):
        ops.moe_down_combine(act, w2, r.experts, r.weights, r.order, 2, out.half())
    with pytest.raises(ValueError, match="w2 must be a contiguous"):
        ops.moe_down_combine(act, w2.half(), r.experts, r.weights, r.order, 2, out)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 12])
def test_fused_moe_replays_under_a_cuda_graph_with_new_routing(t):
    """The layer as the model runs it (t = 1 and 4: both variants; 12: route_gemv, then down and combine apart),
    captured once with PDL launches and replayed on inputs that route differently: each replay equals the eager
    result bit for bit and the twin within bf16 noise, and route_gemv's counter is back at 0."""
    from minillm.ops.launch import pdl_launches, pdl_supported
    dev = _gpu()
    e, k, h, i = 32, 4, 256, 128
    w13, w2 = _experts(e, h, i, torch.bfloat16, dev, 4)
    router = 0.05 * torch.randn(e, h, device=dev)
    x = torch.randn(t, h, device=dev).to(torch.bfloat16)

    def step():
        return moe_ops.fused_moe(x, router, w13, w2, k, True)

    with pdl_launches(pdl_supported(dev)):
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
    g = torch.Generator(device=dev).manual_seed(6)
    for trial in range(4):
        new = torch.randn(t, h, generator=g, device=dev)
        if trial == 3:   # x leaning towards router rows 0..k-1: most tokens on those k experts
            new = new + 3.0 * torch.sign(router[:k].sum(0))
        x.copy_(new.to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert int(moe_ops.route_counter(dev)) == 0
        assert torch.equal(out, step())
        want_routing = moe_ops.route_twin(F.linear(x.float(), router), k, True)
        _, _, want = moe_ops.experts_twin(x, w13, w2, want_routing)
        torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


# ---- check-kernels' MoE cases ---------------------------------------------------------------------------------

def test_check_kernels_cases_cover_empty_experts_one_expert_ties_and_both_dtypes():
    from minillm.diagnostics import moe_check
    experts = list(moe_check.expert_cases(quick=True))
    assert any(t * k < e for _, t, e, k, *_ in experts)                    # experts with zero tokens
    assert any(rule == "one" and t > 32 for _, t, *_, rule, _ in experts)  # one expert, several passes
    assert any(k == 1 for _, _, _, k, *_ in experts)
    assert any(rule == "ties" for *_, rule in moe_check.route_cases(quick=True))
    one = router_logits(40, 16, 0, "one")
    assert (one.argmax(-1) == 15).all()
    ties = router_logits(6, 16, 0, "ties")
    assert (ties[0] == 0.5).all() and torch.equal(ties[1, 1::2], ties[1, 0::2])


def test_check_kernels_cases_cover_the_small_step_variants_within_their_limits():
    from minillm.diagnostics import moe_check
    gemv = list(moe_check.route_gemv_cases(quick=True))
    assert {t for _, t, *_ in gemv} >= {1, moe_ops.ROUTE_GEMV_TOKENS}
    assert all(t <= moe_ops.ROUTE_GEMV_TOKENS for _, t, *_ in gemv)
    assert any(rule == "exact" for *_, rule, _ in gemv) and {dt for *_, dt in gemv} == {"bfloat16", "float16"}
    combined = [c for c in moe_check.expert_cases(quick=True) if c[-1]]
    assert {t for _, t, *_ in combined} >= {1, moe_ops.DOWN_COMBINE_MAX_TOKENS}
    assert any(k == 1 for _, _, _, k, *_ in combined)


def test_exact_router_inputs_sum_exactly_in_any_order_and_tie():
    from minillm.diagnostics.moe_check import router_inputs
    x, w = router_inputs(16, 128, 2048, 0, "exact", torch.bfloat16)
    logits = F.linear(x.float(), w)
    assert torch.equal(logits, (x.double() @ w.double().T).float())   # no rounding anywhere
    assert torch.equal(logits[:, 0], logits[:, 1])


@pytest.mark.gpu
def test_check_kernels_moe_cases_pass():
    _gpu()
    from minillm.diagnostics.moe_check import run_moe_cases
    rows = run_moe_cases(quick=False)
    assert rows and all(r["passed"] for r in rows), [r for r in rows if not r["passed"]]


# ---- scripts/moe_bench.py ---------------------------------------------------------------------------------------

def _bench_module():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "scripts" / "moe_bench.py"
    spec = importlib.util.spec_from_file_location("moe_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_moe_bench_refuses_without_a_gpu(monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    monkeypatch.setattr("sys.argv", ["moe_bench.py"])
    assert _bench_module().main() == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_moe_bench_variants_force_each_pair_and_skip_the_gemv_past_its_token_limit():
    mod = _bench_module()
    assert mod.paths(False, False, 1) == ("torch", "fused")
    assert mod.paths(True, False, 1) == ("torch", "fused", "chain")
    assert mod.paths(False, True, 1) == ("torch", "fused", "chain", "gemv+comb", "gemv", "comb")
    assert mod.paths(False, True, moe_ops.ROUTE_GEMV_TOKENS + 1) == ("torch", "fused", "chain", "comb")
    assert mod.VARIANT_PATHS["comb"] == moe_ops.MoeVariant(route_gemv=False, down_combine=True)


@pytest.mark.gpu
def test_moe_bench_appends_a_line_per_path_and_token_count(tmp_path, monkeypatch):
    _gpu()
    if moe_ops.grouped_mm_unsupported_reason(torch.device("cuda"), torch.bfloat16, 2048, 768) is not None:
        pytest.skip("the torch path needs torch._grouped_mm on this GPU")
    import json
    out = tmp_path / "moe.jsonl"
    monkeypatch.setattr("sys.argv", ["moe_bench.py", "--out", str(out), "--tokens", "1,8", "--layers", "1",
                                     "--replays", "3"])
    assert _bench_module().main() == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(x["tokens"], x["impl"]) for x in lines] == [(1, "torch"), (1, "fused"), (8, "torch"), (8, "fused")]
    assert all(x["layer_us"] > 0 and x["commit"] and x["fingerprint"] for x in lines)
    assert lines[1]["touched_experts"] == 8 and lines[1]["rel_err_vs_torch"] < 3e-2


# ---- the model --------------------------------------------------------------------------------------------------

def test_the_plan_hands_the_model_its_fused_rows_and_torch_path_turns_them_off():
    from minillm.attention.torch_backend import TorchAttentionBackend
    from minillm.model.qwen3_moe import Qwen3MoeForCausalLM, SparseMoeBlock
    from minillm.ops.choice import ModelKernels
    model = Qwen3MoeForCausalLM(resolve_arch(MOE), TorchAttentionBackend(), dtype=torch.bfloat16, device="meta",
                                kernels=ModelKernels(moe_rows=moe_ops.FUSED_MAX_TOKENS))
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == 48 and all(b.fused_rows == moe_ops.FUSED_MAX_TOKENS for b in blocks)
    with model.torch_path():
        assert all(b.fused_rows == 0 for b in blocks)
    assert all(b.fused_rows == moe_ops.FUSED_MAX_TOKENS for b in blocks)
    fp16 = Qwen3MoeForCausalLM(resolve_arch(MOE), TorchAttentionBackend(), dtype=torch.float16, device="meta",
                               kernels=ModelKernels(moe_rows=moe_ops.FUSED_MAX_TOKENS))
    assert fp16.graph_unsupported_reason() is None   # decode steps take the fused kernels, not the host loop


@pytest.mark.gpu
def test_the_moe_block_takes_the_fused_kernels_up_to_its_rows():
    dev = _gpu()
    from minillm.attention.torch_backend import TorchAttentionBackend
    from minillm.model.qwen3_moe import Qwen3MoeForCausalLM, SparseMoeBlock
    from minillm.ops.choice import ModelKernels
    from minillm.model.arch import ModelArchConfig
    arch = ModelArchConfig.from_hf_dict({
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "moe_intermediate_size": 128, "num_experts": 16, "num_experts_per_tok": 4})
    model = Qwen3MoeForCausalLM(arch, TorchAttentionBackend(), dtype=torch.bfloat16, device=dev,
                                kernels=ModelKernels(moe_rows=8))
    block = next(m for m in model.modules() if isinstance(m, SparseMoeBlock))
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=g, device=dev))
        for t in (8, 9):   # 8: the fused kernels; 9: above fused_rows, the grouped_mm / loop path
            x = torch.randn(t, 256, generator=g, device=dev).to(torch.bfloat16)
            want = moe_ops.moe_reference(x.float(), block.gate.weight, block.experts.gate_up_proj.float(),
                                         block.experts.down_proj.float(), 4, arch.norm_topk_prob)
            torch.testing.assert_close(block(x).double(), want, atol=3e-2, rtol=3e-2)

"""MoE routing and grouped-expert ops against plain references: softmax/top-k/renormalise as transformers does it,
per-expert counts and offsets, and both expert paths (grouped_mm and the loop) against a float64 token-by-token
twin, including experts with no tokens and every token on one expert."""
import pytest
import torch
import torch.nn.functional as F

from minillm.ops import moe_ops


def _weights(e, h, i, seed):
    g = torch.Generator().manual_seed(seed)
    return 0.2 * torch.randn(e, 2 * i, h, generator=g), 0.2 * torch.randn(e, h, i, generator=g)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("e,k", [(8, 1), (8, 2), (16, 4), (4, 4)])
def test_route_matches_transformers_router(e, k, renormalize):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    g = torch.Generator().manual_seed(e * 10 + k)
    x = torch.randn(37, 24, generator=g)
    hf = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=24, num_experts=e, num_experts_per_tok=k,
                                           norm_topk_prob=renormalize))
    with torch.no_grad():
        hf.weight.copy_(torch.randn(e, 24, generator=g))
        _, hf_scores, hf_ids = hf(x)
    r = moe_ops.route(F.linear(x, hf.weight.detach()), k, renormalize)
    assert torch.equal(r.experts, hf_ids) and torch.equal(r.weights, hf_scores)
    assert r.weights.dtype == x.dtype
    if renormalize:
        torch.testing.assert_close(r.weights.sum(-1), torch.ones(37))


def test_counts_offsets_and_order():
    experts = torch.tensor([[3, 0], [3, 1], [0, 3], [5, 3]])
    counts, offsets, order = moe_ops.expert_groups(experts, 6)
    assert counts.tolist() == [2, 1, 0, 4, 0, 1]
    assert offsets.tolist() == [0, 2, 3, 3, 7, 7, 8]
    assert counts.dtype == offsets.dtype == torch.int32
    flat = experts.reshape(-1)
    assert flat[order].tolist() == [0, 0, 1, 3, 3, 3, 3, 5]
    assert order.tolist() == [1, 4, 3, 0, 2, 5, 7, 6]   # stable: pairs of one expert keep token order


CASES = {   # name: (tokens, experts, top_k, hidden, intermediate, logits rule)
    "spread": (29, 8, 2, 32, 16, None),
    "top1-most-experts-empty": (3, 16, 1, 32, 16, None),
    "all-on-one-expert": (11, 8, 2, 32, 16, "one"),
    "top-k-equals-E": (7, 4, 4, 16, 8, None),
    "one-token": (1, 8, 3, 32, 16, None),
    "odd-dims-loop-only": (9, 5, 2, 10, 6, None),
}


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_experts_match_reference(case, renormalize):
    t, e, k, h, i, rule = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    x = torch.randn(t, h, generator=g)
    router = torch.randn(e, h, generator=g)
    if rule == "one":   # expert 2 wins every token by far; the second choice still varies
        x = x.abs()
        router[2, :] = 10.0
    w13, w2 = _weights(e, h, i, len(case) + 1)
    r = moe_ops.route(F.linear(x, router), k, renormalize)
    if rule == "one":
        assert (r.experts[:, 0] == 2).all() and r.counts[2] == t
    if case.startswith("top1"):
        assert (r.counts == 0).sum() >= e - t
    want = moe_ops.moe_reference(x, router, w13, w2, k, renormalize)
    paths = [False]
    if moe_ops.grouped_mm_unsupported_reason(x.device, x.dtype, h, i) is None:
        paths.append(True)
    else:
        assert case == "odd-dims-loop-only"
    outs = [moe_ops.grouped_experts(x, w13, w2, r, graph_safe=p) for p in paths]
    for out in outs:
        assert out.shape == (t, h) and out.dtype == x.dtype
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(moe_ops.grouped_experts(x, w13, w2, r), outs[-1])   # the default path is one of them


def test_grouped_mm_reason_names_the_problem():
    assert moe_ops.grouped_mm_unsupported_reason(torch.device("cpu"), torch.float32, 2048, 768) is None
    assert "16 bytes" in moe_ops.grouped_mm_unsupported_reason(torch.device("cpu"), torch.float32, 10, 6)
    assert "float16" in moe_ops.grouped_mm_unsupported_reason(torch.device("cpu"), torch.float16, 64, 32)


@pytest.mark.gpu
def test_graph_safe_path_replays_under_a_cuda_graph_with_new_routing():
    """Captured once, replayed with logits that route differently (other counts, empty experts): the graph must
    give the eager result each time, so no per-step count was baked in."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    dev, dt = torch.device("cuda"), torch.bfloat16
    if moe_ops.grouped_mm_unsupported_reason(dev, dt, 256, 128) is not None:
        pytest.skip(moe_ops.grouped_mm_unsupported_reason(dev, dt, 256, 128))
    g = torch.Generator(device=dev).manual_seed(0)
    e, k, t, h, i = 32, 4, 64, 256, 128
    w13 = (0.05 * torch.randn(e, 2 * i, h, generator=g, device=dev)).to(dt)
    w2 = (0.05 * torch.randn(e, h, i, generator=g, device=dev)).to(dt)
    x = torch.randn(t, h, generator=g, device=dev).to(dt)
    logits = torch.randn(t, e, generator=g, device=dev).to(dt)

    def step():
        return moe_ops.grouped_experts(x, w13, w2, moe_ops.route(logits, k, True), graph_safe=True)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for trial in range(4):
        new = torch.randn(t, e, generator=g, device=dev)
        if trial == 3:
            new[:, :k] += 100.0   # every token on the same k experts, all others empty
        logits.copy_(new.to(dt))
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        assert torch.equal(out, eager)
        ref = moe_ops.grouped_experts(x, w13, w2, moe_ops.route(logits, k, True), graph_safe=False)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)

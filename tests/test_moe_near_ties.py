"""On CPU: the router-aware near-tie rule of the MoE GPU tests (test_moe_gpu.judge_tokens).

- Its router bound stays a few times above what bf16 rounding of the router input does on those tests' checkpoints.
- It names the rule that accepted each token (or first-token logprob), looks only at that token's position, and
  fails naming both margins.
- It rejects real bugs: the torch path in fp32 with two experts' down projections swapped, or with two experts'
  router columns swapped, leaves HF's tokens at a divergence that neither rule accepts.
"""
import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.model.qwen3_moe import Router, SparseMoeBlock
from test_moe_gpu import (MAX_LOGPROB_ERR, NEW_TOKENS, ROUTER_TIE_NATS, SHAPES, TIE_NATS, MoeHF, judge_tokens,
                          make_ckpt, prompts)

SHAPE = "e16-top4-norm-dense1"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {shape: make_ckpt(tmp_path_factory.mktemp(shape), shape) for shape in SHAPES}


@pytest.fixture(scope="module")
def hf(ckpts):
    return MoeHF(ckpts[SHAPE], device="cpu")


def _bf16_rounding_shift(path) -> torch.Tensor:
    """|change of the k-th minus (k+1)-th router logit| when HF fp32's router inputs are rounded to bf16, at every
    position of the GPU tests' first four prompts (665 positions, to stay fast: max 0.06-0.08 nats; all six
    prompts plus HF's greedy tokens gave 0.09)."""
    model = MoeHF(path, device="cpu")
    k, shifts = model.top_k, []

    def measure(router, args):
        x = args[0].reshape(-1, router.weight.shape[1])
        exact, rounded = x @ router.weight.T, x.bfloat16().float() @ router.weight.T
        idx = exact.topk(k + 1, dim=-1).indices[:, -2:]
        gap = lambda logits: logits.gather(1, idx[:, :1]) - logits.gather(1, idx[:, 1:])   # noqa: E731
        shifts.append((gap(rounded) - gap(exact)).abs().flatten())

    hooks = [layer.mlp.gate.register_forward_pre_hook(measure) for layer in model.model.model.layers
             if hasattr(layer.mlp, "gate")]
    for p in prompts()[:4]:
        model.logprobs_and_router_gaps(p)
    for h in hooks:
        h.remove()
    return torch.cat(shifts)


def test_router_bound_is_a_few_times_bf16_rounding(ckpts):
    for shape, path in ckpts.items():
        shift = _bf16_rounding_shift(path)
        assert shift.numel() >= 2 * 660 and shift.max() > 0, shape
        assert shift.max() <= ROUTER_TIE_NATS / 3, f"{shape}: bf16 rounding moves a router gap {shift.max():.3f}"


class FakeHF:
    """Designed log-probabilities ([position, 3 tokens]) and router gaps ([2 MoE layers, position])."""
    top_k, moe_layers = 4, [0, 2]

    def __init__(self, margins: list[float], gaps: torch.Tensor):
        self.lps = torch.tensor([[0.0, -m, -9.0] for m in margins])
        self.gaps = gaps

    def logprobs_and_router_gaps(self, tokens):
        assert self.gaps.shape[1] == len(tokens) == len(self.lps)
        return self.lps, self.gaps


def test_judge_names_the_rule_and_looks_only_at_each_tokens_position():
    prompt, ours = [7, 7], [0, 1, 1, 0]   # our tokens come from positions 1-4; token 1 is HF's second best
    margins = [0.0, 0.0, TIE_NATS - 0.01, 1.0, 0.0]
    wide = torch.full((2, 5), 2.0)
    assert judge_tokens(FakeHF(margins, wide), prompt, [0, 0, 0, 0]) == []
    with pytest.raises(AssertionError, match="token 2: 1, HF's best 0, 1.000 nats below") as err:
        judge_tokens(FakeHF(margins, wide), prompt, ours)
    assert "router gap 2.000" in str(err.value) and "neither rule accepts it" in str(err.value)
    earlier = wide.clone()
    earlier[0, 2] = 0.0   # a tie at token 1's position does not excuse token 2
    with pytest.raises(AssertionError, match="neither rule accepts it"):
        judge_tokens(FakeHF(margins, earlier), prompt, ours)
    tied = wide.clone()
    tied[1, 3] = ROUTER_TIE_NATS - 0.01
    first, second = judge_tokens(FakeHF(margins, tied), prompt, ours)
    assert "token 1" in first and "logit near-tie" in first
    assert "token 2" in second and "router near-tie" in second and "at layer 2" in second


def test_judge_lets_a_router_tie_excuse_the_first_logprob_only_at_the_prompts_last_position():
    prompt, ours = [7, 7], [0, 0, 0, 0]
    margins = [0.0] * 5
    wide = torch.full((2, 5), 2.0)
    assert judge_tokens(FakeHF(margins, wide), prompt, ours, first_logprob=-MAX_LOGPROB_ERR + 0.01) == []
    with pytest.raises(AssertionError, match="first-token logprob off by 0.600 .*neither rule accepts it"):
        judge_tokens(FakeHF(margins, wide), prompt, ours, first_logprob=-0.6)
    tied = wide.clone()
    tied[0, 1] = 0.1   # position 1: the prompt's last, whose logits give token 0
    [verdict] = judge_tokens(FakeHF(margins, tied), prompt, ours, first_logprob=-0.6)
    assert "first-token logprob off by 0.600: router near-tie" in verdict and "at layer 0" in verdict


def _swap_down_proj(model):
    for block in (m for m in model.modules() if isinstance(m, SparseMoeBlock)):
        w = block.experts.down_proj.data
        w[[0, 1]] = w[[1, 0]].clone()


def _swap_router_columns(monkeypatch):
    logits = Router.logits
    monkeypatch.setattr(Router, "logits", lambda self, x: logits(self, x)[:, [1, 0, *range(2, self.weight.shape[0])]])


@pytest.mark.parametrize("bug", [None, "down_proj of experts 0 and 1 swapped", "router columns 0 and 1 swapped"])
def test_judge_rejects_wrong_experts_on_the_torch_path(ckpts, hf, bug, monkeypatch):
    llm = LLM(str(ckpts[SHAPE]), device="cpu", dtype="float32", max_model_len=256)
    if bug and bug.startswith("down_proj"):
        _swap_down_proj(llm.engine.runner.model)
    elif bug:
        _swap_router_columns(monkeypatch)
    ps = prompts()[:3]
    outs = llm.generate(ps, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS), use_tqdm=False)
    rejected = []
    for p, out in zip(ps, outs):
        try:
            judge_tokens(hf, p, out.token_ids)
        except AssertionError as e:
            rejected.append(str(e))
    if bug is None:
        assert [o.token_ids for o in outs] == [hf.greedy(p) for p in ps] and not rejected
    else:
        assert len(rejected) >= 2, f"{bug}: accepted on {3 - len(rejected)} of 3 prompts"

"""fp8 KV scales from the start-up calibration prefill (minillm/runner/kv_calibration.py), on the CPU: the rule,
the amax it reads against the k/v the attention backend was handed, its place behind checkpoint scales, the
config switch, and what it buys on a model whose values the fp8 range cannot hold at scale 1.0."""
import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.config import ConfigError, EngineConfig
from minillm.runner import kv_calibration as kc
from tiny_models import make_tiny_checkpoint, make_tiny_moe_checkpoint, with_demo_tokenizer, with_tensors

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("cal"), arch="qwen3", vocab=256, seed=2)


def _llm(path, **kw):
    return LLM(str(path), device="cpu", dtype="float32", max_model_len=128, **kw)


def test_the_rule_puts_the_largest_value_at_half_the_range_and_keeps_1_where_amax_says_nothing():
    amax = torch.tensor([[[224.0, 1.0], [0.0, float("nan")]], [[float("inf"), 4480.0], [2.24, 1e-30]]])
    s = kc.scales_from_amax(amax, E4M3)
    assert s[0, 0].tolist() == [1.0, pytest.approx(1 / 224)]
    assert s[0, 1].tolist() == [1.0, 1.0] and s[1, 0, 0] == 1.0        # amax 0, NaN, inf: 1.0
    assert s[1, 0, 1] == pytest.approx(20.0) and s[1, 1, 0] == pytest.approx(0.01)
    assert s[1, 1, 1] > 0 and torch.isfinite(s).all()
    assert kc.scales_from_amax(torch.tensor([57344.0 / 2]), E5M2).item() == 1.0


def _kind(kind, root):
    if kind == "moe":
        return make_tiny_moe_checkpoint(root / kind, seed=3)
    path = make_tiny_checkpoint(root / kind, arch=kind.split("+")[0], vocab=4096 if "+" in kind else 256, seed=4,
                                **({"hidden": 64, "heads": 4, "head_dim": 16} if kind == "qwen2" else {}))
    return with_demo_tokenizer(path) if "+" in kind else path


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "moe", "qwen3+tokenizer"])
def test_calibrated_scales_are_2_amax_over_448_of_the_kv_the_backend_was_given(kind, tmp_path, monkeypatch):
    """The amax the calibration reads back from its scratch cache is that of the k/v each layer handed the
    attention backend during the calibration prefill (recorded here by wrapping the backend's forward); for
    Qwen3, Qwen2, Qwen3-MoE, and with a tokenizer (the calibration text) or without (seeded ids)."""
    ckpt = _kind(kind, tmp_path)
    seen = []
    from minillm.attention.torch_backend import TorchAttentionBackend
    forward = TorchAttentionBackend.forward

    def recording(self, q, k, v, *rest):
        if self.kv_spec is not None and not self.kv_spec.quantized:   # the calibration's scratch cache
            n = rest[2].num_tokens
            seen.append(torch.stack([k[:n].abs().amax(dim=(0, 2)), v[:n].abs().amax(dim=(0, 2))]))
        return forward(self, q, k, v, *rest)

    monkeypatch.setattr(TorchAttentionBackend, "forward", recording)
    llm = _llm(ckpt, kv_cache_dtype="fp8")
    got = llm.engine.runner.kv_spec.scales.cpu()
    want = kc.scales_from_amax(torch.stack(seen).float(), E4M3)
    assert len(seen) == got.shape[0] and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (got != 1.0).all()


def test_checkpoint_scales_win_and_the_switch_turns_calibration_off(ckpt, tmp_path):
    d = with_tensors(ckpt, tmp_path / "scaled", {"model.layers.0.self_attn.k_scale": torch.tensor(0.5)})
    s = _llm(d, kv_cache_dtype="fp8").engine.runner.kv_spec.scales.cpu()
    assert s[0, 0].tolist() == [0.5, 0.5] and (s.flatten()[2:] == 1.0).all()   # the checkpoint's, 1.0 elsewhere
    off = _llm(ckpt, kv_cache_dtype="fp8", calculate_kv_scales=False).engine.runner.kv_spec.scales
    assert (off == 1.0).all()
    assert _llm(ckpt).engine.runner.kv_spec.scales is None                     # no fp8: nothing to calibrate


def test_the_switch_must_be_a_bool():
    with pytest.raises(ConfigError, match="calculate_kv_scales"):
        EngineConfig.from_kwargs("demo", calculate_kv_scales="yes")


def _loud(src, dst, factor):
    """src with every v_proj multiplied by `factor`: values far past e4m3's 448 at scale 1.0."""
    return with_tensors(src, dst, lambda w: {n: t * factor for n, t in w.items() if n.endswith("v_proj.weight")})


def test_calibration_keeps_values_the_unit_scale_saturates(ckpt, tmp_path):
    """v_proj x 1000 (V up to ~3,400): at scale 1.0 the fp8 cache saturates V at 448, and the next token's
    logprobs move ten times further from the fp32 cache's than with calibrated scales (measured 0.47 against
    0.047 over the reference's top 5; the tail of this random model's distribution reorders under any fp8
    rounding, so it is left out)."""
    loud = _loud(ckpt, tmp_path / "loud", 1000.0)
    prompt = [list(range(3, 40))]
    params = SamplingParams(max_tokens=1, logprobs=20, **GREEDY)

    def top(**kw) -> dict[int, float]:
        return _llm(loud, **kw).generate(prompt, params, use_tqdm=False)[0].logprobs[0].top

    ref = top()

    def err(got: dict[int, float]) -> float:   # over the reference's top 5 (a token it lost counts as inf)
        return max(abs(got.get(t, float("-inf")) - ref[t]) for t in sorted(ref, key=ref.get, reverse=True)[:5])

    calibrated = err(top(kv_cache_dtype="fp8"))
    unit = err(top(kv_cache_dtype="fp8", calculate_kv_scales=False))
    assert calibrated < 0.1 < unit and calibrated * 4 < unit

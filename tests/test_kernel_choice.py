"""Kernel choice from the config (minillm/ops/choice.py, config key kernels.*): whether the CUDA kernels load for an
engine (no process-wide switch, a build failure loud under auto and an error under cuda), the documented
environment aliases folded into the config, and the plan's decisions reaching every layer of the model. The plan's
per-path verdicts are tests/test_plan.py."""
import pytest

from minillm.config import ConfigError, EngineConfig, env_alias_values
from minillm.ops import build, choice
from minillm.ops.choice import ModelKernels, load_cuda_kernels


def cfg(**kw) -> EngineConfig:
    return EngineConfig.from_kwargs(**kw)


def test_cpu_loads_nothing_and_cuda_is_a_config_error():
    assert not load_cuda_kernels(cfg(), "cpu").loaded
    with pytest.raises(ConfigError, match="need a CUDA device"):
        load_cuda_kernels(cfg(kernels="cuda"), "cpu")
    with pytest.raises(ConfigError, match="attention"):
        cfg(kernels="torch", attention="cuda")


def test_gpu_loads_the_kernels_unless_the_config_says_torch(monkeypatch):
    monkeypatch.setattr(build, "load_extension", lambda: object())
    assert load_cuda_kernels(cfg(), "cuda").loaded
    assert load_cuda_kernels(cfg(kernels="cuda", attention="torch"), "cuda").loaded   # attention alone on torch
    for c in (cfg(kernels="torch"), cfg(attention="torch")):                          # the whole torch path
        load = load_cuda_kernels(c, "cuda")
        assert not load.loaded and load.reason.startswith(("kernels.backend=torch", "runtime.attention=torch"))


def test_build_failure_is_loud_under_auto_and_an_error_under_cuda(monkeypatch, capsys):
    def broken():
        raise build.ExtensionError("building the CUDA kernels failed: nvcc not found")

    monkeypatch.setattr(build, "load_extension", broken)
    monkeypatch.setattr(choice, "_warned", set())
    load = load_cuda_kernels(cfg(), "cuda")
    assert not load.loaded and "nvcc not found" in load.unavailable
    err = capsys.readouterr().err
    assert "nvcc not found" in err and "kernels.backend" in err and err.count("warning") == 1
    load_cuda_kernels(cfg(), "cuda")
    assert capsys.readouterr().err == ""             # once per process
    with pytest.raises(ConfigError, match="nvcc not found"):
        load_cuda_kernels(cfg(kernels="cuda"), "cuda")


def test_environment_aliases_are_config(monkeypatch):
    assert env_alias_values({}) == {}
    assert env_alias_values({"MINI_ENGINE_OPS": "0"}) == {"kernels": {"backend": "torch"}}
    assert env_alias_values({"MINI_ENGINE_OPS": "1", "MINI_ENGINE_ATTN": "unified"}) == \
        {"runtime": {"attention_mode": "unified"}}
    with pytest.raises(ConfigError, match="MINI_ENGINE_OPS"):
        env_alias_values({"MINI_ENGINE_OPS": "off"})
    monkeypatch.setenv("MINI_ENGINE_OPS", "0")
    assert cfg().kernels.backend == "torch"
    assert cfg(kernels="auto").kernels.backend == "auto"   # an explicit setting wins over the alias


def test_config_loader_reads_aliases_under_set_and_flags(monkeypatch):
    from minillm.config_loader import load_config

    monkeypatch.setenv("MINI_ENGINE_ATTN", "unified")
    assert load_config(None)[0].runtime.attention_mode == "unified"
    assert load_config(None, ["runtime.attention_mode=split"])[0].runtime.attention_mode == "split"
    assert load_config(None, attention_mode="split")[0].runtime.attention_mode == "split"


def test_choice_reaches_every_layer():
    """The model's layers take the decisions they are given (no module-level switch): every op-calling module
    carries them, each linear layer its own skinny GEMM verdict, and torch_path() switches them all off and back."""
    import torch

    from minillm.attention.torch_backend import TorchAttentionBackend
    from minillm.model.arch import ModelArchConfig
    from minillm.model.layers import Linear
    from minillm.model.qwen3 import QwenForCausalLM

    arch = ModelArchConfig.from_hf_dict(dict(architectures=["Qwen3ForCausalLM"], vocab_size=64, hidden_size=32,
                                             intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                             num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                                             rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True))
    on = ModelKernels(cuda=True, skinny=frozenset({"o_proj", "down_proj"}))
    model = QwenForCausalLM(arch, TorchAttentionBackend(), dtype=torch.float32, kernels=on)
    flags = [m.cuda_ops for m in model.modules() if hasattr(m, "cuda_ops")]
    skinny = {name.rsplit(".", 1)[1] for name, m in model.named_modules() if isinstance(m, Linear) and m.skinny}
    assert len(flags) == 1 + 3 * 2 and all(flags) and skinny == {"o_proj", "down_proj"}
    with model.torch_path():
        assert not any(m.cuda_ops for m in model.modules() if hasattr(m, "cuda_ops"))
        assert not any(m.skinny for m in model.modules() if isinstance(m, Linear))
    assert all(m.cuda_ops for m in model.modules() if hasattr(m, "cuda_ops"))
    default = QwenForCausalLM(arch, TorchAttentionBackend(), dtype=torch.float32)
    assert not any(m.cuda_ops for m in default.modules() if hasattr(m, "cuda_ops"))

"""Kernel choice from the config (minillm/ops/choice.py, config key kernels.*): one resolved object, no process-wide
switch, the documented environment aliases folded into the config, a build failure loud under auto and an error
under cuda, and the choice reaching every layer of the model."""
import types

import pytest

from minillm.config import ConfigError, EngineConfig, env_alias_values
from minillm.ops import build, choice
from minillm.ops.choice import KernelChoice, resolve_kernels

CPU = types.SimpleNamespace(type="cpu")
GPU = types.SimpleNamespace(type="cuda")   # the resolution only asks the device's type


def cfg(**kw) -> EngineConfig:
    return EngineConfig.from_kwargs(**kw)


def test_cpu_resolves_to_torch_and_cuda_is_a_config_error():
    assert resolve_kernels(cfg(), CPU) == KernelChoice.torch_only()
    with pytest.raises(ConfigError, match="need a CUDA device"):
        resolve_kernels(cfg(kernels="cuda"), CPU)
    with pytest.raises(ConfigError, match="attention"):
        cfg(kernels="torch", attention="cuda")


def test_gpu_with_kernels(monkeypatch):
    monkeypatch.setattr(build, "load_extension", lambda: object())
    monkeypatch.setattr(choice, "_pdl_supported", lambda device: True)
    k = resolve_kernels(cfg(skinny_gemm=False, decode_ctas_per_sm=4), GPU)
    assert (k.cuda, k.attention, k.skinny_gemm, k.decode_ctas_per_sm, k.megakernel_max_batch, k.pdl) == \
        (True, "cuda", False, 4, 16, True)
    assert not resolve_kernels(cfg(pdl=False), GPU).pdl
    monkeypatch.setattr(choice, "_pdl_supported", lambda device: False)   # before sm_90
    assert not resolve_kernels(cfg(), GPU).pdl
    # --attention torch alone means the torch path; with kernels=cuda, only attention leaves the kernels
    assert resolve_kernels(cfg(attention="torch"), GPU) == KernelChoice.torch_only()
    k = resolve_kernels(cfg(attention="torch", kernels="cuda"), GPU)
    assert k.cuda and k.attention == "torch" and k.megakernel_max_batch == 0
    assert resolve_kernels(cfg(kernels="torch"), GPU) == KernelChoice.torch_only()
    assert resolve_kernels(cfg(megakernel=False), GPU).megakernel_max_batch == 0


def test_build_failure_is_loud_under_auto_and_an_error_under_cuda(monkeypatch, capsys):
    def broken():
        raise build.ExtensionError("building the CUDA kernels failed: nvcc not found")

    monkeypatch.setattr(build, "load_extension", broken)
    monkeypatch.setattr(choice, "_warned", set())
    k = resolve_kernels(cfg(), GPU)
    assert not k.cuda and k.unavailable and k.record()["cuda_ops"] is False
    err = capsys.readouterr().err
    assert "nvcc not found" in err and "kernels.backend" in err and err.count("warning") == 1
    resolve_kernels(cfg(), GPU)
    assert capsys.readouterr().err == ""             # once per process
    with pytest.raises(ConfigError, match="nvcc not found"):
        resolve_kernels(cfg(kernels="cuda"), GPU)


def test_record_names_every_choice():
    rec = KernelChoice.torch_only().record()
    assert set(rec) == {"cuda_ops", "attention", "attention_mode", "skinny_gemm", "decode_min_partitions",
                        "decode_ctas_per_sm", "megakernel_max_batch", "megakernel_max_tokens", "megakernel_min_chunks",
                        "pdl", "unavailable"}


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
    """The model's layers take the choice they are given (no module-level switch): every op-calling module
    carries it, and torch_path() switches them all off and back."""
    import torch

    from minillm.attention.torch_backend import TorchAttentionBackend
    from minillm.model.arch import ModelArchConfig
    from minillm.model.layers import Linear
    from minillm.model.qwen3 import QwenForCausalLM

    arch = ModelArchConfig.from_hf_dict(dict(architectures=["Qwen3ForCausalLM"], vocab_size=64, hidden_size=32,
                                             intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                             num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                                             rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True))
    on = KernelChoice(cuda=True, attention="cuda", attention_mode="split", skinny_gemm=True,
                      decode_min_partitions=1, decode_ctas_per_sm=8)
    model = QwenForCausalLM(arch, TorchAttentionBackend(), dtype=torch.float32, kernels=on)
    flags = [m.cuda_ops for m in model.modules() if hasattr(m, "cuda_ops")]
    skinny = [m.skinny for m in model.modules() if isinstance(m, Linear)]
    assert len(flags) == 1 + 3 * 2 and all(flags) and len(skinny) == 8 and all(skinny)
    with model.torch_path():
        assert not any(m.cuda_ops for m in model.modules() if hasattr(m, "cuda_ops"))
        assert not any(m.skinny for m in model.modules() if isinstance(m, Linear))
    assert all(m.cuda_ops for m in model.modules() if hasattr(m, "cuda_ops"))
    default = QwenForCausalLM(arch, TorchAttentionBackend(), dtype=torch.float32)
    assert not any(m.cuda_ops for m in default.modules() if hasattr(m, "cuda_ops"))

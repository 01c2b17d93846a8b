"""Loader, ModelArchConfig and presets: packing, sharding, dtype conversion, dummy weights, clear errors."""
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from minillm.config import ConfigError
from minillm.model import loader
from minillm.model.arch import ModelArchConfig
from minillm.model.loader import load_model
from minillm.model.registry import get_model_class
from tiny_models import make_tiny_checkpoint

TINY = dict(architectures=["Qwen3ForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=48,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=64, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def qwen2_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("q2") / "m", "qwen2", tie=False, seed=3)


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_packed_layout_matches_checkpoint_tensors(qwen2_ckpt):
    model, arch, path = load_model(str(qwen2_ckpt), dtype="float32", device="cpu")
    assert path == qwen2_ckpt and arch.qkv_bias and not arch.qk_norm
    ckpt = load_file(qwen2_ckpt / "model.safetensors")
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    pre = "model.layers.1."
    for part in ("weight", "bias"):
        expected = torch.cat([ckpt[f"{pre}self_attn.{x}_proj.{part}"] for x in "qkv"])
        assert torch.equal(getattr(attn.qkv_proj, part), expected)
    assert torch.equal(mlp.gate_up_proj.weight,
                       torch.cat([ckpt[f"{pre}mlp.gate_proj.weight"], ckpt[f"{pre}mlp.up_proj.weight"]]))
    assert torch.equal(model.lm_head.weight, ckpt["lm_head.weight"])
    assert sum(p.numel() for p in model.parameters()) == arch.num_params


def test_sharded_checkpoint_loads_identically(tmp_path):
    whole = make_tiny_checkpoint(tmp_path / "whole", "qwen3", seed=5)
    sharded = make_tiny_checkpoint(tmp_path / "sharded", "qwen3", seed=5, sharded=True)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    a = _params(load_model(str(whole), dtype="float32", device="cpu")[0])
    b = _params(load_model(str(sharded), dtype="float32", device="cpu")[0])
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_tied_embeddings_share_one_matrix(tmp_path):
    model, arch, _ = load_model(str(make_tiny_checkpoint(tmp_path / "t", tie=True)), dtype="float32", device="cpu")
    assert arch.tie_word_embeddings and model.lm_head is None
    assert model.lm_head_weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("stored,requested", [(torch.bfloat16, "float32"), (torch.float32, "bfloat16"),
                                              (torch.float16, torch.float32)])
def test_dtype_conversion(tmp_path, stored, requested):
    path = make_tiny_checkpoint(tmp_path / "d", dtype=stored)
    model, _, _ = load_model(str(path), dtype=requested, device="cpu")
    want = requested if isinstance(requested, torch.dtype) else getattr(torch, requested)
    with safe_open(path / "model.safetensors", framework="pt") as f:
        raw = f.get_tensor("model.layers.0.mlp.down_proj.weight")
    assert raw.dtype == stored
    got = model.model.layers[0].mlp.down_proj.weight
    assert got.dtype == want and torch.equal(got, raw.to(want))


def test_auto_dtype_is_float32_on_cpu(qwen2_ckpt):
    model, _, _ = load_model(str(qwen2_ckpt), dtype="auto", device="cpu")
    assert model.model.norm.weight.dtype == torch.float32
    assert loader.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_qwen3_preset_shape_arithmetic():
    arch = ModelArchConfig.from_hf_dict(json.loads((loader.PRESET_DIR / "qwen3-0.6b.json").read_text()))
    assert (arch.num_hidden_layers, arch.head_dim, arch.num_key_value_heads, arch.rope_theta) == (28, 128, 8, 1e6)
    assert 595e6 < arch.num_params < 597e6
    assert abs(arch.weight_bytes(2) - 1.19e9) < 0.01e9     # architecture.md 7: 1.19 GB in bf16, LM head included
    assert arch.kv_bytes_per_token(2) == 112 * 1024          # 28 layers x 8 heads x 128 x 2 B x (K, V)


def test_qwen25_preset_derives_head_dim_and_bias():
    arch = ModelArchConfig.from_hf_dict(json.loads((loader.PRESET_DIR / "qwen2.5-0.5b.json").read_text()))
    assert arch.head_dim == 64 and arch.qkv_bias and not arch.qk_norm
    assert arch.num_attention_heads // arch.num_key_value_heads == 7
    assert 493e6 < arch.num_params < 495e6


def test_full_qwen3_preset_builds_on_meta_device():
    model, arch, path = load_model("qwen3-0.6b", "auto", "bfloat16", "meta")
    assert path is None and len(model.model.layers) == 28
    assert sum(p.numel() for p in model.parameters()) == arch.num_params
    assert model.model.layers[0].self_attn.qkv_proj.weight.shape == (4096, 1024)


def test_dummy_weights_are_seeded_and_shaped(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    a = load_model(str(tmp_path), "dummy", "float32", "cpu", seed=1)[0]
    b = load_model(str(tmp_path), "dummy", "float32", "cpu", seed=1)[0]
    c = load_model(str(tmp_path), "dummy", "float32", "cpu", seed=2)[0]
    w = a.model.embed_tokens.weight
    assert torch.equal(w, b.model.embed_tokens.weight) and not torch.equal(w, c.model.embed_tokens.weight)
    assert 0.015 < w.std() < 0.025
    assert torch.equal(a.model.layers[1].self_attn.q_norm.weight, torch.ones(8))


def test_config_from_transformers4_style_dict():
    d = dict(TINY, architectures=["Qwen2ForCausalLM"], rope_theta=5e5, rope_scaling=None, torch_dtype="bfloat16",
             eos_token_id=[1, 2])
    d.pop("head_dim")
    arch = ModelArchConfig.from_hf_dict(d)
    assert (arch.head_dim, arch.rope_theta, arch.torch_dtype, arch.eos_token_id) == (8, 5e5, "bfloat16", [1, 2])
    assert get_model_class(arch.architecture).__name__ == "QwenForCausalLM"


@pytest.mark.parametrize("change,match", [
    ({"architectures": ["LlamaForCausalLM"]}, "Qwen3ForCausalLM, Qwen2ForCausalLM"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope type 'dynamic' is not supported"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"hidden_size": 0}, "hidden_size=0"),
    ({"use_sliding_window": True}, "use_sliding_window"),
])
def test_bad_configs_are_named(change, match):
    with pytest.raises(ConfigError, match=match):
        ModelArchConfig.from_hf_dict(dict(TINY, **change))


def test_missing_directory_config_and_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nope"), device="cpu")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path), device="cpu")
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    with pytest.raises(FileNotFoundError, match=r"\*\.safetensors"):
        load_model(str(tmp_path), device="cpu")


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3")
    tensors = load_file(path / "model.safetensors")
    tensors.pop("model.layers.1.self_attn.k_proj.weight")
    tensors["model.layers.1.extra.weight"] = torch.zeros(2)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ConfigError, match=r"missing tensors \['model.layers.1.self_attn.k_proj.weight'\], "
                                          r"unexpected tensors \['model.layers.1.extra.weight'\]"):
        load_model(str(path), device="cpu")


def test_wrong_tensor_shape_is_named(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3")
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(7)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ConfigError, match=r"model.norm.weight has shape \(7,\)"):
        load_model(str(path), device="cpu")


@pytest.mark.parametrize("dtype", [torch.int8, torch.int64, torch.bool])
def test_integer_and_bool_weights_are_refused(tmp_path, dtype):
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3")
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(dtype)
    save_file(tensors, path / "model.safetensors")
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(ConfigError, match=rf"tensor model.norm.weight is stored as {name}; weights must be one of "
                                          r"float32, bfloat16, float16"):
        load_model(str(path), device="cpu")


def test_a_tensor_in_two_shards_without_an_index_is_refused(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3")
    tensors = load_file(path / "model.safetensors")
    save_file({"model.norm.weight": torch.zeros_like(tensors["model.norm.weight"])}, path / "z-extra.safetensors")
    with pytest.raises(ConfigError, match=r"tensor model.norm.weight is stored twice, in \S*model.safetensors and "
                                          r"in \S*z-extra.safetensors"):
        load_model(str(path), device="cpu")


def test_demo_model_absent_and_bad_arguments(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "DEMO_MODEL_DIR", tmp_path / "demo_model")
    with pytest.raises(FileNotFoundError, match="demo model"):
        load_model(None, device="cpu")
    with pytest.raises(ConfigError, match="ships no weights"):
        load_model("qwen3-0.6b", "safetensors", device="meta")
    with pytest.raises(ValueError, match="load_format='pt'"):
        load_model("qwen3-0.6b", "pt", device="meta")
    with pytest.raises(ValueError, match="dtype='int8'"):
        load_model("qwen3-0.6b", dtype="int8", device="meta")

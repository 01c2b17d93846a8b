"""Build a QwenForCausalLM from an HF directory, a bundled preset, or the demo model.

Weights go from safetensors straight into the model's packed parameters, one checkpoint tensor at a time
(no second full copy of the model). `load_format="dummy"` fills the same parameters with seeded random values
on the target device instead, for benchmarks of shapes whose checkpoint is not at hand.

dtype "auto" means float32 on CPU (exact reference path) and bfloat16 on CUDA.
"""
from __future__ import annotations

import json
import re
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from minillm.config import ConfigError
from minillm.device import resolve_device, resolve_dtype  # noqa: F401 (part of the loader's API)
from minillm.limits import check_weights_fit
from minillm.model.arch import ModelArchConfig
from minillm.model.qwen3 import QwenForCausalLM
from minillm.model.registry import get_model_class
from minillm.untrusted import loads_json

PRESET_DIR = Path(__file__).resolve().parent.parent / "presets"
DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "demo_model"
DEMO_NAME = "demo"   # --model demo: the embedded demo model, by name (null/None means the same)
# Packed module name -> {shard: the checkpoint module name whose weight (and bias) fills that shard's rows}.
_PACKED = {
    "qkv_proj": {"q": "q_proj", "k": "k_proj", "v": "v_proj"},
    "gate_up_proj": {"gate": "gate_proj", "up": "up_proj"},
}
# Buffers some older checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Weight dtypes a checkpoint may store. copy_ would cast an int8/int64/bool tensor to the model's dtype without a
# word and serve garbage; quantized checkpoints need their scales, which this loader does not read.
_WEIGHT_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# KV-cache scales of fp8 checkpoints (vLLM's and llm-compressor's names), read by read_kv_scales, not weights:
# model.layers.{i}.self_attn.{k,v}_scale, ...self_attn.attn.{k,v}_scale, ...self_attn.{k,v}_proj.{k,v}_scale,
# ...self_attn.{k,v}_proj.output_scale.
_KV_SCALE_RE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:attn\.|([kv])_proj\.)?(?:([kv])_scale|output_scale)$")


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def resolve_arch(model: str | None, load_format: str = "auto") -> ModelArchConfig:
    """The architecture `model` names (directory, preset, demo), read from its config.json without loading."""
    return _resolve_source(model, load_format)[0]


def load_model(model: str | None, load_format: str = "auto", dtype: torch.dtype | str = "auto",
               device: torch.device | str = "auto", attn_backend=None, *, seed: int = 0, kernels=None
               ) -> tuple[QwenForCausalLM, ModelArchConfig, Path | None]:
    """Returns (model in eval mode, its ModelArchConfig, the model directory or None for a preset).

    model: HF directory, preset name (see preset_names()), or None for the bundled demo model.
    load_format: auto | safetensors | dummy (auto = dummy for presets, safetensors for directories).
    seed: seeds the dummy weights. kernels: the ModelKernels of the engine's plan (None: plain torch).
    """
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"load_format={load_format!r} is not allowed: one of auto, safetensors, dummy")
    if attn_backend is None:
        from minillm.attention.torch_backend import TorchAttentionBackend
        attn_backend = TorchAttentionBackend()
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    arch, path = _resolve_source(model, load_format)
    fmt = "dummy" if path is None or load_format == "dummy" else "safetensors"
    files = _weight_files(path) if fmt == "safetensors" else {}
    check_weights_fit(arch, torch.tensor([], dtype=torch_dtype).element_size(), dev,
                      f"model {str(path) if path is not None else model!r}")
    net = get_model_class(arch.architecture)(arch, attn_backend, dtype=torch_dtype, device=dev, kernels=kernels)
    if fmt == "dummy":
        init_dummy_weights(net, seed)
    else:
        load_safetensors(net, files)
    return net.eval(), arch, path


def _resolve_source(model: str | None, load_format: str) -> tuple[ModelArchConfig, Path | None]:
    if model is None or model == DEMO_NAME and not _is(Path(model).exists):
        if not DEMO_MODEL_DIR.is_dir():
            raise FileNotFoundError(f"the demo model directory {DEMO_MODEL_DIR} is missing; pass a model "
                                    f"directory or a preset ({', '.join(preset_names())})")
        return ModelArchConfig.from_dir(DEMO_MODEL_DIR), DEMO_MODEL_DIR
    preset = PRESET_DIR / f"{model}.json"
    path = Path(model).expanduser()   # `--model=~/x` and LLM("~/x") reach us unexpanded
    if "/" not in model and _is(preset.is_file) and not _is(path.exists):
        if load_format == "safetensors":
            raise ConfigError(f"preset {model!r} ships no weights: use load_format dummy (or auto)")
        return ModelArchConfig.from_hf_dict(json.loads(preset.read_text())), None
    if not _is(path.is_dir):
        what = "is not a directory" if _is(path.exists) else "does not exist"
        shown = str(path) if len(str(path)) <= 200 else str(path)[:197] + "..."
        raise FileNotFoundError(f"model directory {shown} {what}, and it is not a preset either (presets: "
                                f"{', '.join(preset_names())}, or {DEMO_NAME} for the demo model)")
    return ModelArchConfig.from_dir(path), path


def _is(check) -> bool:
    """A path test that says False where the OS refuses the question (a name too long, a bad character)."""
    try:
        return check()
    except (OSError, ValueError):
        return False


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> file holding it, from model.safetensors.index.json or by listing each file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return _indexed_files(path, index)
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors weights in {path} (use load_format dummy for random weights)")
    files: dict[str, Path] = {}
    for shard in shards:
        with _open_weights(shard) as f:
            for name in f.keys():
                if name in files:   # without an index nothing says which copy is meant: refuse, never pick one
                    raise ConfigError(f"tensor {name} is stored twice, in {files[name]} and in {shard}; keep one "
                                      f"copy, or add a model.safetensors.index.json that names the file to use")
                files[name] = shard
    return files


def _indexed_files(path: Path, index: Path) -> dict[str, Path]:
    try:
        data = loads_json(index.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{index} is not valid JSON: {e}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                                   for k, v in weight_map.items()):
        raise ConfigError(f"{index} needs a 'weight_map' object of tensor name -> file name")
    for fname in set(weight_map.values()):
        if not (path / fname).is_file():
            raise FileNotFoundError(f"{path / fname} is listed in {index.name} but missing")
    return {name: path / fname for name, fname in weight_map.items()}


@contextmanager
def _open_weights(file: Path):
    """safe_open that turns a truncated, empty or corrupt file (a SafetensorError, which is no OSError or
    ValueError) into a ConfigError naming the file, also when a tensor read fails inside the block."""
    try:
        with safe_open(file, framework="pt") as f:
            yield f
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ConfigError(f"weights file {file} cannot be read: {e} (is it truncated or not safetensors?)") from None


def _checkpoint_targets(net: QwenForCausalLM, names=frozenset()
                        ) -> dict[str, tuple[torch.Tensor, tuple[int, int] | None]]:
    """Every tensor name the checkpoint must provide -> (parameter, row range of a packed one or None).
    A module with `checkpoint_targets(prefix, names)` (stacked MoE experts) names its own, given the checkpoint's."""
    targets = {}
    for mname, module in net.named_modules():
        if hasattr(module, "checkpoint_targets"):
            targets.update(module.checkpoint_targets(mname, names))
            continue
        shards = getattr(module, "shards", None)
        for leaf, p in module.named_parameters(recurse=False):
            if not shards:
                targets[f"{mname}.{leaf}"] = (p, None)
                continue
            parent, local = mname.rsplit(".", 1)
            for shard, rows in shards.items():
                targets[f"{parent}.{_PACKED[local][shard]}.{leaf}"] = (p, rows)
    return targets


def load_safetensors(net: QwenForCausalLM, files: dict[str, Path], shard=None) -> None:
    """Copy every checkpoint tensor into its (slice of a) parameter, converting dtype on the way.
    shard(name, view) -> tensor: a tensor-parallel rank's part of a checkpoint tensor, read through safetensors'
    get_slice view so that only that part is read (minillm/parallel/tp_model.py)."""
    names = {n for n in files if not n.endswith(_IGNORED_SUFFIXES) and _kv_scale_key(n) is None}
    targets = _checkpoint_targets(net, names)
    if net.arch.tie_word_embeddings:
        names.discard("lm_head.weight")   # some tied checkpoints still store the shared matrix twice
    missing, unexpected = sorted(set(targets) - names), sorted(names - set(targets))
    if missing or unexpected:
        raise ConfigError(f"checkpoint does not match {net.arch.architecture}: missing tensors {missing}, "
                          f"unexpected tensors {unexpected}")
    by_file: dict[Path, list[str]] = {}
    for name in sorted(names):
        by_file.setdefault(files[name], []).append(name)
    for file, file_names in by_file.items():
        with _open_weights(file) as f:
            for name in file_names:
                tensor = f.get_tensor(name) if shard is None else shard(name, f.get_slice(name))
                _copy_into(targets[name], name, tensor)


def _copy_into(target: tuple[torch.Tensor, tuple[int, int] | None], name: str, tensor: torch.Tensor) -> None:
    param, rows = target
    dest = param.data if rows is None else param.data[rows[0]:rows[1]]
    if tuple(tensor.shape) != tuple(dest.shape):
        raise ConfigError(f"tensor {name} has shape {tuple(tensor.shape)}; the config implies {tuple(dest.shape)}")
    if tensor.dtype not in _WEIGHT_DTYPES:
        raise ConfigError(f"tensor {name} is stored as {str(tensor.dtype).removeprefix('torch.')}; weights must be "
                          f"one of {', '.join(_WEIGHT_DTYPES.values())} (quantized checkpoints are not supported)")
    dest.copy_(tensor)   # copy_ converts dtype and moves to the parameter's device in one go


def init_dummy_weights(net: QwenForCausalLM, seed: int = 0) -> None:
    """Norm weights 1, everything else N(0, 0.02), drawn on the parameters' own device from one seeded
    generator in parameter order (so the same seed gives the same model)."""
    gen = None
    for pname, p in net.named_parameters():
        if p.device.type == "meta":
            continue
        if gen is None:
            gen = torch.Generator(device=p.device).manual_seed(seed)
        if pname.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02, generator=gen)


def _kv_scale_key(name: str) -> tuple[int, int] | None:
    """(layer, 0 for K / 1 for V) of a KV-cache scale tensor name, or None for any other tensor."""
    m = _KV_SCALE_RE.match(name)
    if m is None:
        return None
    proj, kind = m.group(2), m.group(3)
    if kind is None and proj is None:      # self_attn.output_scale is no KV scale
        return None
    if proj is not None and kind is not None and proj != kind:   # k_proj.v_scale: not a name anyone writes
        return None
    return int(m.group(1)), 0 if (kind or proj) == "k" else 1


def read_kv_scales(model_dir: Path | None, arch: ModelArchConfig) -> torch.Tensor | None:
    """The checkpoint's KV-cache scales as fp32 [layers, 2 (K, V), KV heads], or None when it has none.

    A scalar (or one-element) scale is per tensor and applies to every KV head; a [KV heads] one is per head.
    Layers the checkpoint gives no scale keep 1.0. Any other shape, a layer index outside the model, or a
    non-finite or non-positive value is a ConfigError naming the tensor."""
    if model_dir is None:
        return None
    files = _weight_files(model_dir)
    found = {n: key for n in files if (key := _kv_scale_key(n)) is not None}
    if not found:
        return None
    heads, layers = arch.num_key_value_heads, arch.num_hidden_layers
    scales = torch.ones(layers, 2, heads, dtype=torch.float32)
    for name, (layer, kv) in sorted(found.items()):
        with _open_weights(files[name]) as f:
            t = f.get_tensor(name).float()
        if layer >= layers:
            raise ConfigError(f"KV-cache scale {name}: layer {layer} is outside the model's {layers} layers")
        if t.numel() == 1:
            t = t.reshape(1).expand(heads)
        elif tuple(t.shape) != (heads,):
            raise ConfigError(f"KV-cache scale {name} has shape {list(t.shape)}: expected a scalar (per tensor) "
                              f"or [{heads}] (per KV head)")
        if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
            raise ConfigError(f"KV-cache scale {name} must be finite and > 0, got {t.tolist()[:8]}")
        scales[layer, kv] = t
    return scales

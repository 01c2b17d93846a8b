"""KVCacheSpec: the one description of the paged KV cache that KV sizing, allocation, the attention backends, the
KV-write kernels and their references read.

Layout "nhd" (the only one today): per layer a K and a V tensor of shape [num_blocks, block_size, num_kv_heads,
head_dim]; token t of a sequence lives at flat slot block_table[t // block_size] * block_size + t % block_size.
All layers are views of one allocation [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].

cache.kv_cache_dtype is "auto" (= the model dtype), the model dtype spelled out, or an fp8 format (fp8 = e4m3fn,
fp8_e5m2). An fp8 spec carries `scales`, fp32 [num_layers, 2 (K, V), num_kv_heads]: stored = x / scale, read =
stored * scale (minillm/ops/kv_quant.py). A backend finds a layer's scales from its cache tensors
(layer_scales), so the model passes (k_cache, v_cache) per layer whatever the cache dtype.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minillm.config import ConfigError
from minillm.ops.kv_quant import FP8_DTYPES, is_fp8, unit_scales

LAYOUTS = ("nhd",)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    layout: str = "nhd"
    scales: torch.Tensor | None = field(default=None, compare=False, repr=False)   # fp8 only, see above
    # data_ptr of every layer's k_cache this spec allocated -> its layer (layer_scales)
    _layer_of: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def for_model(cls, arch, block_size: int, kv_cache_dtype: str, model_dtype: torch.dtype,
                  scales: torch.Tensor | None = None) -> "KVCacheSpec":
        """The cache of a model (ModelArchConfig) under the cache config's block size and kv_cache_dtype.
        scales: an fp8 cache's [layers, 2, Hkv] (from the checkpoint); None = 1.0 everywhere."""
        layers, heads = arch.num_hidden_layers, arch.num_key_value_heads
        if kv_cache_dtype in FP8_DTYPES:
            scales = unit_scales(layers, heads) if scales is None else scales.float()
            check_scales_shape(scales, layers, heads)
            return cls(layers, heads, arch.head_dim, block_size, FP8_DTYPES[kv_cache_dtype], scales=scales)
        dtype = model_dtype if kv_cache_dtype == "auto" else _DTYPES.get(kv_cache_dtype)
        if dtype is None or dtype != model_dtype:
            raise ConfigError(f"cache.kv_cache_dtype={kv_cache_dtype!r} is not allowed with model dtype "
                              f"{str(model_dtype).removeprefix('torch.')}: the cache holds the model dtype or "
                              "fp8 (use auto, fp8 or fp8_e5m2)")
        return cls(layers, heads, arch.head_dim, block_size, dtype)

    @property
    def quantized(self) -> bool:
        return is_fp8(self.dtype)

    @property
    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers (the scales are per layer, not per token: not counted)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_dim)

    def allocate(self, num_blocks: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One tensor for every layer's K and V; per layer (k_cache, v_cache) views. Zero-filled, so that a padded
        row reading a stale slot sees finite numbers, never NaN."""
        kv = torch.zeros(self.num_layers, 2, num_blocks, *self.block_shape(), dtype=self.dtype, device=device)
        layers = [(kv[i, 0], kv[i, 1]) for i in range(self.num_layers)]
        if self.quantized:
            self.scales_on(device)
            for i, (k, _) in enumerate(layers):
                self._layer_of[k.data_ptr()] = i
        return layers

    def scales_on(self, device) -> torch.Tensor:
        """The scales on `device` (moved there once; a CUDA graph keeps reading that copy)."""
        dev, have = torch.device(device), self.scales.device
        if have.type != dev.type or (dev.index is not None and have.index != dev.index):
            object.__setattr__(self, "scales", self.scales.to(dev))
        return self.scales

    def layer_scales(self, k_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """(k_scale [Hkv], v_scale [Hkv]) of the layer whose k_cache this is; (None, None) unquantised."""
        if not self.quantized:
            return None, None
        layer = self._layer_of.get(k_cache.data_ptr())
        if layer is None:
            raise ValueError("an fp8 k_cache that this KVCacheSpec did not allocate: its scales are unknown")
        s = self.scales_on(k_cache.device)
        return s[layer, 0], s[layer, 1]

    def mismatch(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
        """Why a layer's (k_cache, v_cache) does not follow this spec, or None."""
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.dim() != 4 or tuple(t.shape[1:]) != self.block_shape():
                return f"{name} has shape {list(t.shape)}, the spec [num_blocks, {', '.join(map(str, self.block_shape()))}]"
            if t.dtype != self.dtype:
                return f"{name} has dtype {t.dtype}, the spec {self.dtype}"
        return None


def check_scales_shape(scales: torch.Tensor, num_layers: int, num_kv_heads: int) -> None:
    if tuple(scales.shape) != (num_layers, 2, num_kv_heads):
        raise ConfigError(f"KV-cache scales have shape {list(scales.shape)}, expected "
                          f"[{num_layers}, 2, {num_kv_heads}] (layers, K/V, KV heads)")
    if not bool(torch.isfinite(scales).all()) or not bool((scales > 0).all()):
        raise ConfigError("KV-cache scales must be finite and > 0")

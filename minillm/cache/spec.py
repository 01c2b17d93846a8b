"""KVCacheSpec: the one description of the paged KV cache that KV sizing, allocation, the attention backends, the
KV-write kernels and their references read.

Layout "nhd" (the only one today): per layer a K and a V tensor of shape [num_blocks, block_size, num_kv_heads,
head_dim]; token t of a sequence lives at flat slot block_table[t // block_size] * block_size + t % block_size.
All layers are views of one allocation [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].

cache.kv_cache_dtype is "auto" (= the model dtype) or the model dtype spelled out. A quantised cache (fp8 e4m3
with scales, next) will add its dtype and scale layout here, and everything that sizes or reads the cache follows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.config import ConfigError

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

    @classmethod
    def for_model(cls, arch, block_size: int, kv_cache_dtype: str, model_dtype: torch.dtype) -> "KVCacheSpec":
        """The cache of a model (ModelArchConfig) under the cache config's block size and kv_cache_dtype."""
        dtype = model_dtype if kv_cache_dtype == "auto" else _DTYPES.get(kv_cache_dtype)
        if dtype is None or dtype != model_dtype:
            raise ConfigError(f"cache.kv_cache_dtype={kv_cache_dtype!r} is not allowed with model dtype "
                              f"{str(model_dtype).removeprefix('torch.')}: the cache holds the model dtype for now "
                              "(use auto)")
        return cls(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, block_size, dtype)

    @property
    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
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
        return [(kv[i, 0], kv[i, 1]) for i in range(self.num_layers)]

    def mismatch(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
        """Why a layer's (k_cache, v_cache) does not follow this spec, or None."""
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.dim() != 4 or tuple(t.shape[1:]) != self.block_shape():
                return f"{name} has shape {list(t.shape)}, the spec [num_blocks, {', '.join(map(str, self.block_shape()))}]"
            if t.dtype != self.dtype:
                return f"{name} has dtype {t.dtype}, the spec {self.dtype}"
        return None

"""Data-parallel replicas: which device each engine-core process gets, and where each request goes."""
from __future__ import annotations

import dataclasses

from minillm.config import ConfigError, EngineConfig

_PREFIX_TOKENS = 64          # the prompt head that keys the prefix-cache-aware tie-break
_PREFIX_MEMORY = 4096        # prompt heads remembered for it
_NEVER = 1 << 62             # the load of a replica that died


def replica_config(cfg: EngineConfig, replica: int) -> EngineConfig:
    """Replica i's config: on a GPU it takes cuda:(base + i * tp), so replicas (and their tensor-parallel ranks)
    never share a device; on the CPU every replica runs on the CPU."""
    dp, tp = cfg.parallel.data_parallel_size, cfg.parallel.tensor_parallel_size
    device = cfg.runtime.device
    if dp == 1 or device == "cpu":
        return cfg
    import torch
    if device == "auto" and not torch.cuda.is_available():
        return cfg
    base = int(device[5:]) if device.startswith("cuda:") else 0
    index = base + replica * tp
    count = torch.cuda.device_count()
    if base + dp * tp > count:
        raise ConfigError(f"parallel.data_parallel_size={dp} x tensor_parallel_size={tp} from cuda:{base} needs "
                          f"{base + dp * tp} GPUs, but {count} are visible")
    return dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, device=f"cuda:{index}"))


class LeastLoaded:
    """Send each request to the replica with the fewest tokens in flight: each replica's own count (running +
    waiting tokens, reported with its outputs) plus what was sent to it since. On a tie, the replica that last got
    a prompt with the same head, whose prefix cache may hold it."""

    def __init__(self, num_replicas: int):
        self.reported = [0] * num_replicas
        self.sent = [0] * num_replicas
        self.alive = [True] * num_replicas
        self._heads: dict[tuple, int] = {}

    def remove(self, replica: int) -> None:
        """A replica that died gets nothing more."""
        self.alive[replica] = False

    def choose(self, prompt_ids: list[int]) -> int:
        loads = [r + s if ok else _NEVER for r, s, ok in zip(self.reported, self.sent, self.alive)]
        low = min(loads)
        head = tuple(prompt_ids[:_PREFIX_TOKENS])
        best = self._heads.get(head)
        if best is None or loads[best] != low:
            best = loads.index(low)
        if len(self._heads) >= _PREFIX_MEMORY:
            self._heads.pop(next(iter(self._heads)))
        self._heads[head] = best
        self.sent[best] += len(prompt_ids)
        return best

    def report(self, replica: int, load_tokens: int) -> None:
        self.reported[replica] = load_tokens
        self.sent[replica] = 0

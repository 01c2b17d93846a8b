"""torch.distributed for tensor parallelism: process groups, the rendezvous, and the collectives the model uses.

Each engine core with tensor_parallel_size > 1 is one process group: NCCL on CUDA (all-reduces, the logits
gather, the sampled tokens' broadcast; all CUDA-graph capturable) plus a gloo group on the CPU for the control
messages (the plain SchedulerOutput of every step, minillm/contract.py).

Rendezvous: minillm starts the ranks itself (spawn) and meets them in a file store in a temporary directory;
under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set: the one place minillm reads the environment for
a choice, because torchrun passes its rendezvous that way) it uses torchrun's env:// rendezvous instead.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

_STARTUP_TIMEOUT_S = 600.0
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world_size: int
    local_rank: int


def torchrun_env() -> TorchrunEnv | None:
    """torchrun's rendezvous, when this process was started by torchrun."""
    if not all(os.environ.get(v) for v in _TORCHRUN_VARS):
        return None
    return TorchrunEnv(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                       int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))


class TPGroup:
    """This rank's view of its tensor-parallel group."""

    def __init__(self, rank: int, world_size: int, device: torch.device, init_method: str, timeout_s: float):
        self.rank, self.world_size, self.device = rank, world_size, device
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:   # ranks on one CPU share its cores instead of each spinning up a thread per core
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        # The rendezvous waits for ranks that are still starting (importing torch, under load: tens of seconds);
        # the groups the engine uses are made once everyone is there, with the collective timeout.
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=max(_STARTUP_TIMEOUT_S, timeout_s)))
        timeout = timedelta(seconds=timeout_s)
        self.group = dist.new_group(backend=backend, timeout=timeout)
        self.cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else self.group

    # ---- the model's collectives ----
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0: the ranks' [N, d] pieces side by side, [N, world * d]; other ranks: their own piece (what
        they size scratch memory by; they never sample from it)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if self.rank == 0 else x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        dist.broadcast(x, src=0, group=self.group)
        return x

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    # ---- control (rank 0 -> the others) ----
    def send_control(self, msg) -> None:
        dist.broadcast_object_list([msg], src=0, group=self.cpu_group)

    def recv_control(self):
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

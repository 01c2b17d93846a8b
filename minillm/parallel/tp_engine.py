"""Starting a tensor-parallel engine: rank 0's runner here (the engine core that schedules wraps it), ranks 1.. as
spawned worker processes, or
every rank under torchrun (then this process is the rank torchrun says; ranks other than 0 serve rank 0 and
exit when it stops).

Faults: a worker that dies makes the next collective fail (gloo: at once; NCCL: at
parallel.distributed_timeout_s); a watchdog on the workers' process sentinels logs which rank died at once and,
in an engine-core process, ends that process so the front end fails every request within seconds. A worker
whose rank 0 is gone exits by itself.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

import torch

from minillm.parallel.dist import TPGroup, torchrun_env

log = logging.getLogger("minillm.engine")

_JOIN_TIMEOUT_S = 10.0
_PARENT_POLL_S = 0.5


def rank_device(cfg, rank: int) -> torch.device:
    from minillm.device import resolve_device
    base = resolve_device(cfg.runtime.device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def _rank_config(cfg, device: torch.device):
    import dataclasses
    return dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, device=str(device)))


def build_tp_runner(cfg):
    """Rank 0's runner, a TPDriver (minillm/parallel/tp_runner.py), for the EngineCore to wrap."""
    from minillm.parallel.tp_runner import TPDriver, TPModelRunner, serve_rank

    from minillm.model.loader import resolve_arch
    from minillm.parallel.tp_model import check_divisible

    tp = cfg.parallel.tensor_parallel_size
    check_divisible(resolve_arch(cfg.model.model, cfg.model.load_format), tp)   # before any rank starts
    env = torchrun_env()
    if env is not None:
        if env.world_size != tp:
            from minillm.config import ConfigError
            raise ConfigError(f"parallel.tensor_parallel_size={tp} is not allowed under torchrun with "
                              f"WORLD_SIZE={env.world_size}: they must match")
        device = rank_device(_local_device(cfg, env.local_rank), 0)
        group = TPGroup(env.rank, tp, device, "env://", cfg.parallel.distributed_timeout_s)
        runner = TPModelRunner(_rank_config(cfg, device), group)
        if env.rank != 0:
            serve_rank(runner)
            group.close()
            sys.exit(0)
        return TPDriver(runner, on_close=group.close)
    workers = Workers(cfg)
    try:
        device = rank_device(cfg, 0)
        group = TPGroup(0, tp, device, workers.init_method, cfg.parallel.distributed_timeout_s)
        runner = TPModelRunner(_rank_config(cfg, device), group)
    except BaseException:
        workers.close()
        raise
    workers.watch()

    def close():
        workers.close()
        group.close()
    return TPDriver(runner, workers, on_close=close)


def _local_device(cfg, local_rank: int):
    """Under torchrun each process takes cuda:LOCAL_RANK (the CPU stays the CPU)."""
    import dataclasses
    dev = cfg.runtime.device
    if dev == "cpu" or (dev == "auto" and not torch.cuda.is_available()):
        return cfg
    return dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, device=f"cuda:{local_rank}"))


class Workers:
    """Ranks 1.. as spawned processes, meeting rank 0 in a file store in a temporary directory."""

    def __init__(self, cfg):
        tp = cfg.parallel.tensor_parallel_size
        self._dir = tempfile.mkdtemp(prefix="minillm-tp-")
        self.init_method = f"file://{self._dir}/rendezvous"
        mp = multiprocessing.get_context("spawn")
        self.procs = [mp.Process(target=run_worker, name=f"minillm-tp-{r}", daemon=True,
                                 args=(cfg, r, self.init_method, os.getpid())) for r in range(1, tp)]
        for p in self.procs:
            p.start()
        self.dead: str | None = None
        self._closing = False

    def watch(self) -> None:
        threading.Thread(target=self._watch, name="minillm-tp-watchdog", daemon=True).start()

    def _watch(self) -> None:
        multiprocessing.connection.wait([p.sentinel for p in self.procs])
        if self._closing:
            return
        self.dead = self.dead_rank()
        log.error("%s: the engine cannot go on", self.dead)
        print(f"minillm: error: {self.dead}", file=sys.stderr, flush=True)
        if multiprocessing.parent_process() is not None:   # an engine-core process: end it, the front end fails
            os._exit(1)                                     # every request and reports it

    def dead_rank(self) -> str | None:
        """Which rank has exited, if one has (waits a moment: a collective can fail just before the exit is
        visible)."""
        ready = multiprocessing.connection.wait([p.sentinel for p in self.procs], timeout=2.0)
        if not ready:
            return None
        rank = 1 + [p.sentinel for p in self.procs].index(ready[0])
        return f"tensor-parallel rank {rank} exited (exit code {self.procs[rank - 1].exitcode})"

    def close(self) -> None:
        self._closing = True
        for p in self.procs:
            p.join(_JOIN_TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join(_JOIN_TIMEOUT_S)
        shutil.rmtree(self._dir, ignore_errors=True)


def run_worker(cfg, rank: int, init_method: str, parent_pid: int) -> None:
    """multiprocessing (spawn) target of ranks 1..: build the rank's runner, serve rank 0 until it stops."""
    from minillm.parallel.tp_runner import TPModelRunner, serve_rank

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    device = rank_device(cfg, rank)
    group = TPGroup(rank, cfg.parallel.tensor_parallel_size, device, init_method, cfg.parallel.distributed_timeout_s)
    try:
        serve_rank(TPModelRunner(_rank_config(cfg, device), group))
    finally:
        group.close()


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_POLL_S)
    os._exit(0)

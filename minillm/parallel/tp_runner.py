"""A tensor-parallel rank's ModelRunner, rank 0's driver that mirrors every runner call to the other ranks, and
the loop those ranks run.

Every rank runs the same ModelRunner code on the same plain SchedulerOutput (rank 0 broadcasts each one), so the
collectives inside the model line up by construction. Rank 0 samples from the gathered logits and broadcasts the
sampled ids, so every rank's request state (and the next step's inputs) stays the same.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref

import torch

from minillm.parallel.tp_model import local_arch, parallelize, shard_kv_scales, shard_tensor
from minillm.runner.model_runner import ModelRunner
from minillm.sampling.sampler import SamplerResult

log = logging.getLogger("minillm.engine")


def tp_config(cfg):
    """The config a rank runs: no decode megakernel (it covers one whole model on one GPU, not a shard), and no
    skinny or decode GEMM (the plan decides those per layer from the unsharded shapes)."""
    return dataclasses.replace(cfg, kernels=dataclasses.replace(cfg.kernels, megakernel=False, skinny_gemm=False,
                                                                decode_gemm=False))


class TPModelRunner(ModelRunner):
    def __init__(self, cfg, group):
        self.group = group
        super().__init__(tp_config(cfg))
        inner = self.sampler
        self.sampler = _BroadcastSampler(inner, group) if group.rank == 0 else _ReceivedSampler(group)
        if group.rank != 0:
            self.grammar = _NoGrammar()   # only rank 0 samples: the others would compile and fill masks for nothing

    def _load_model(self):
        from minillm.limits import check_weights_fit
        from minillm.model.loader import (_resolve_source, _weight_files, init_dummy_weights, load_safetensors)
        from minillm.model.registry import get_model_class

        cfg, tp, rank = self.cfg, self.group.world_size, self.group.rank
        arch, path = _resolve_source(cfg.model.model, cfg.model.load_format)
        self.full_arch = arch
        local = local_arch(arch, tp)
        check_weights_fit(local, torch.tensor([], dtype=self.dtype).element_size(), self.device,
                          f"tensor-parallel rank {rank} of {tp}")
        net = get_model_class(arch.architecture)(local, self.attn_backend, dtype=self.dtype, device=self.device,
                                                 kernels=self.plan.model_kernels())
        if path is None or cfg.model.load_format == "dummy":
            init_dummy_weights(net, cfg.runtime.seed)
        else:
            load_safetensors(net, _weight_files(path), shard=shard_tensor(arch, tp, rank))
        parallelize(net, self.group)
        return net.eval(), local, path

    def _checkpoint_kv_scales(self):
        from minillm.model.loader import read_kv_scales
        scales = read_kv_scales(self.model_dir, self.full_arch)   # checked against every KV head, then this rank's
        return None if scales is None else shard_kv_scales(scales, self.full_arch, self.group.world_size,
                                                           self.group.rank)

    def _choose_num_blocks(self) -> int:
        return self.group.min_int(super()._choose_num_blocks())   # the smallest pool of all ranks

    @property
    def vocab_size(self) -> int:
        return self.full_arch.vocab_size   # rank 0 samples over the gathered, whole vocabulary


class _NoGrammar:
    """The grammar rows of a rank that does not sample: no matcher, no mask."""

    def update(self, so) -> None:
        pass

    def masks(self, sampled, seq_lens, prev, beside: bool = True):
        return None

    def close(self) -> None:
        pass


class _BroadcastSampler:
    """Rank 0: sample, then send the ids to the other ranks."""

    def __init__(self, inner, group):
        self.inner, self.group = inner, group

    def __call__(self, logits, batch, grammar=None) -> SamplerResult:
        result = self.inner(logits, batch, grammar)
        self.group.broadcast(result.token_ids)
        return result


class _ReceivedSampler:
    """The other ranks: the ids rank 0 sampled (their logits are only their vocabulary slice: unused)."""

    def __init__(self, group):
        self.group = group

    def __call__(self, logits, batch, grammar=None) -> SamplerResult:
        ids = torch.empty(batch.num_rows, dtype=torch.int64, device=self.group.device)
        return SamplerResult(self.group.broadcast(ids), None)


class TPDriver:
    """Rank 0's runner as the EngineCore sees it: each call is sent to the other ranks, then run here."""

    def __init__(self, runner: TPModelRunner, workers=None, on_close=None):
        self.runner, self.group = runner, runner.group
        self.workers = workers   # the spawned ranks (None under torchrun)
        # Also at collection and at exit: the other ranks are told to stop, not left to find a closed socket.
        self._finalizer = weakref.finalize(self, _stop_ranks, runner.group, on_close)

    def __getattr__(self, name):
        return getattr(self.runner, name)   # the facts: model_dir, dtype, num_blocks, max_model_len, ...

    @property
    def arch(self):
        return self.runner.full_arch         # the model's shape (the rank's own is runner.arch)

    def execute(self, so, prof=None):
        with self._failures():
            self.group.send_control(("execute", so, False))
            return self.runner.execute(so, prof)

    def launch(self, so, prev, prof=None):
        with self._failures():
            self.group.send_control(("launch", so, prev is not None))
            return self.runner.launch(so, prev, prof)

    def resolve(self, inflight, prof=None):
        with self._failures():
            return self.runner.resolve(inflight, prof)

    def update_states(self, so) -> None:
        with self._failures():
            self.group.send_control(("update", so, False))
            self.runner.update_states(so)

    @contextlib.contextmanager
    def _failures(self):
        """A collective that failed because a rank is gone says which rank."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - re-raised, with the reason when it is known
            dead = self.workers.dead_rank() if self.workers is not None else None
            if dead is None:
                raise
            raise RuntimeError(f"{dead}; the tensor-parallel engine cannot go on ({type(e).__name__})") from e

    def close(self) -> None:
        self._finalizer()


def _stop_ranks(group, on_close) -> None:
    try:
        group.send_control(("stop", None, False))
    except Exception:  # noqa: BLE001 - a rank that is gone cannot be told
        pass
    if on_close is not None:
        on_close()


def serve_rank(runner: TPModelRunner) -> None:
    """Ranks 1..: run what rank 0 sends until it says stop. Rank 0 resolves a launched step later (async
    scheduling) or at once (execute); a rank resolves its own in the same order, so its request state matches."""
    group, pending = runner.group, None
    while True:
        cmd, so, has_prev = group.recv_control()
        if cmd == "stop":
            return
        if cmd == "update":
            runner.update_states(so)
        elif cmd == "execute":
            if pending is not None:
                runner.resolve(pending)
                pending = None
            runner.execute(so)
        elif cmd == "launch":
            if pending is not None and not has_prev:
                runner.resolve(pending)
                pending = None
            launched = runner.launch(so, pending)
            if pending is not None:
                runner.resolve(pending)
            pending = launched

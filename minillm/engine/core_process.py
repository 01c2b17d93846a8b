"""The engine core in a process of its own: the loop that runs there (see minillm/engine/core_client.py for the
front end's side).

    front end (tokenize, detokenize, stop strings, HTTP)          engine-core process (one per replica)
    CoreClient  --AddRequest / FinishRequests / Shutdown-->  PULL  EngineCore: schedule -> execute -> update
                <--Ready, StepOutputs (+ load), Rejected, Failed-- PUSH

The process ignores SIGINT (Ctrl-C reaches the whole process group; the front end drains and then says
Shutdown) and exits by itself once its parent is gone, so a killed front end leaves nothing running.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import pickle
import signal
import sys
import time
from dataclasses import dataclass, field

import zmq

from minillm.engine.core_messages import (AddRequest, Failed, FinishRequests, Ready, Rejected, Shutdown,
                                          StepOutputs, encoder, to_core)
from minillm.engine.profile import StepProfile

log = logging.getLogger("minillm.engine")

_IDLE_POLL_MS = 500          # an idle core checks on its parent this often
_SEND_TIMEOUT_MS = 1000      # a send blocked this long (nobody reads) checks on the parent
_ZERO_COPY_BYTES = 1 << 16   # pyzmq's zero-copy send pays for itself only on large messages
EXIT_LINE = "minillm engine core "   # + replica + ": " + the loop's summary as JSON (scripts/http_latency.py reads it)


@dataclass
class EngineFacts:
    """What the front end needs to know about a loaded engine (sent once, with Ready)."""
    model_dir: object            # Path | None
    arch: object                 # ModelArchConfig
    dtype: object                # torch.dtype
    device: object               # torch.device
    plan: object                 # the runner's ExecutionPlan (minillm/runner/plan.py)
    vocab_size: int              # the sampled vocabulary (a tensor-parallel rank's arch holds only its slice)
    max_model_len: int
    num_blocks: int
    block_size: int


def facts_of(core) -> EngineFacts:
    r = core.runner
    return EngineFacts(r.model_dir, r.arch, r.dtype, r.device, r.plan, r.vocab_size, core.max_model_len,
                       r.num_blocks, core.cfg.cache.block_size)


def build_core(cfg):
    """The EngineCore this process runs: tensor-parallel rank 0 when the config asks for TP."""
    from minillm.engine.core import EngineCore
    if cfg.parallel.tensor_parallel_size > 1:
        from minillm.parallel.tp_engine import build_tp_runner
        return EngineCore(cfg, runner=build_tp_runner(cfg))
    return EngineCore(cfg)


def run_engine_core(cfg, replica: int, in_addr: str, out_addr: str, parent_pid: int) -> None:
    """multiprocessing (spawn) target: load the engine, say Ready (or why not), then serve until Shutdown."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    inp, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (inp, out):
        sock.setsockopt(zmq.LINGER, 0)
    out.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
    inp.connect(in_addr)
    out.connect(out_addr)
    loop = None
    try:
        try:
            core = build_core(cfg)
        except BaseException as e:  # noqa: BLE001 - the front end re-raises it (a ConfigError stays one)
            _send(out, Failed(replica, [], _pickled_error(e)), parent_pid)
            return
        gc.collect()   # a serving process: no full collection pause in a token's latency (minillm.llm.freeze_heap)
        gc.freeze()
        _send(out, Ready(replica, pickle.dumps(facts_of(core))), parent_pid)
        loop = CoreLoop(core, inp, out, replica, parent_pid)
        loop.run()
    finally:
        if loop is not None:
            loop.close()
        inp.close()
        out.close()
        ctx.term()


def _pickled_error(e: BaseException) -> str:
    """The exception as hex pickle (so the front end raises the same type), or its text if it does not pickle."""
    try:
        return "pickle:" + pickle.dumps(e).hex()
    except Exception:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def _send(sock, msg, parent_pid: int) -> None:
    data = encoder.encode(msg)
    while True:
        try:
            sock.send(data, copy=len(data) < _ZERO_COPY_BYTES)
            return
        except zmq.Again:        # nobody reads: carry on only while the front end lives
            if os.getppid() != parent_pid:
                raise SystemExit(0) from None


class CoreLoop:
    def __init__(self, core, inp, out, replica: int, parent_pid: int):
        from minillm.request import RequestStatus
        self.core, self.inp, self.out = core, inp, out
        self.replica, self.parent_pid = replica, parent_pid
        self.status = RequestStatus
        self.report_load = core.cfg.parallel.data_parallel_size > 1   # DP=1: no per-step load count
        self.poller = zmq.Poller()
        self.poller.register(inp, zmq.POLLIN)
        self.reported = core.stats()
        self.times = LoopTimes()
        core.profile = self.times.profile   # a few clock reads a step: the exit line's breakdown

    def run(self) -> None:
        core = self.core
        while True:
            if not core.has_unfinished_requests() and not self.poller.poll(_IDLE_POLL_MS):
                if os.getppid() != self.parent_pid:
                    return
                continue
            if not self._take_inputs():
                return
            if not (core.has_unfinished_requests() and self._step()):
                self._report_stats()   # e.g. an abort freed blocks: the front end's gauges must see it
            if os.getppid() != self.parent_pid:   # one cheap syscall a step
                return

    def _take_inputs(self) -> bool:
        """Apply every message that has arrived; False on Shutdown."""
        while True:
            try:
                data = self.inp.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            msg = to_core.decode(data)
            if isinstance(msg, AddRequest):
                self._add(msg)
            elif isinstance(msg, FinishRequests):
                self.core.finish_requests(msg.request_ids, self.status(msg.status))
            elif isinstance(msg, Shutdown):
                return False

    def _add(self, msg: AddRequest) -> None:
        from minillm.request import Request
        req = Request(msg.request_id, msg.prompt_token_ids, msg.sampling_params,
                      eos_token_ids=frozenset(msg.eos_token_ids), priority=msg.priority)
        try:
            self.core.add_request(req)
        except ValueError as e:
            _send(self.out, Rejected(self.replica, msg.request_id, str(e)), self.parent_pid)

    def _report_stats(self) -> None:
        stats = self.core.stats()
        if stats != self.reported:
            self.reported = stats
            _send(self.out, StepOutputs(self.replica, [], stats, self._load()), self.parent_pid)

    def _step(self) -> bool:
        """One step; True if it sent outputs (with the stats)."""
        core = self.core
        t0 = time.perf_counter()
        try:
            outputs = core.step()
        except Exception as e:  # noqa: BLE001 - the requests it held are answered with the error
            log.exception("engine step failed")
            ids = list(core.scheduler.requests)
            core.finish_requests(ids, self.status.FINISHED_ABORTED)
            _send(self.out, Failed(self.replica, ids, f"engine step failed: {type(e).__name__}: {e}"),
                  self.parent_pid)
            return False
        t1 = time.perf_counter()
        if not outputs:
            self.times.add(t1 - t0, 0.0)
            return False
        self.reported = core.stats()
        _send(self.out, StepOutputs(self.replica, outputs, self.reported, self._load()), self.parent_pid)
        self.times.add(t1 - t0, time.perf_counter() - t1)
        return True

    def _load(self) -> int:
        if not self.report_load:
            return 0
        return sum(len(r.all_token_ids) for r in self.core.scheduler.requests.values())

    def close(self) -> None:
        from minillm.engine.engine import close_core
        close_core(self.core)
        if self.times.steps:
            sys.stderr.write(f"{EXIT_LINE}{self.replica}: {json.dumps(self.times.summary())}\n")
        sys.stdout.flush()


@dataclass
class LoopTimes:
    """Where the core loop's busy time went (reported once, at exit): the steps by phase, and sending their
    outputs."""
    steps: int = 0
    step_s: float = 0.0
    send_s: float = 0.0
    profile: StepProfile = field(default_factory=StepProfile)

    def add(self, step_s: float, send_s: float) -> None:
        self.steps += 1
        self.step_s += step_s
        self.send_s += send_s

    def summary(self) -> dict:
        """Steps, ms a step, the StepProfile's phases and paths, and ms a step spent sending outputs."""
        n, prof = self.steps, self.profile.summary()
        return {"steps": n, "step_ms": 1e3 * self.step_s / n, "send_ms": 1e3 * self.send_s / n,
                "phase_ms": prof["ms_per_step"], "paths": prof["paths"], "mean_rows": prof["mean_rows"],
                "gpu_ms": prof["gpu_ms_per_step"]}

"""CoreClient: the front end's handle on engine-core processes (minillm/engine/core_process.py), one per
data-parallel replica. It stands where an in-process EngineCore stands in LLMEngine (add_request,
finish_requests, step, drain, stats), so the output processor, the LLM API and every front end above it work
unchanged.

step() returns the CoreOutputs that arrived (waiting for at least one while requests are live); the cores step on
their own, so the front end's work (detokenizing, HTTP, JSON) overlaps the GPU's instead of sharing a GIL with
the scheduler. wake() interrupts a waiting step() so that new requests are sent at once.

Sockets are ipc:// in a temporary directory removed at close(); processes are spawned (CUDA-safe) and joined
(or killed) at close() and at interpreter exit, so starting and stopping engines leaks nothing.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import shutil
import tempfile
import weakref

import zmq

from minillm.engine.core_messages import (AddRequest, Failed, FinishRequests, Ready, Rejected, Shutdown,
                                          StepOutputs, encoder, from_core)
from minillm.engine.core_process import run_engine_core
from minillm.engine.outputs import CoreOutput, EngineStats
from minillm.parallel.replicas import LeastLoaded, replica_config

log = logging.getLogger("minillm.engine")

_JOIN_TIMEOUT_S = 5.0


class EngineDeadError(RuntimeError):
    """An engine-core process is gone: every request it held is lost, and the engine cannot go on."""


class RequestsFailed(RuntimeError):
    """Some requests are lost (their data-parallel replica died) while the engine serves on; request_ids names
    them (core request ids from CoreClient, user request ids from LLMEngine)."""

    def __init__(self, message: str, request_ids: list[str]):
        super().__init__(message)
        self.request_ids = request_ids


class _Remote:
    """The facts a front end reads from `engine.runner` (model dir, arch, dtype, device, execution plan)."""

    def __init__(self, facts):
        self.model_dir, self.arch, self.dtype = facts.model_dir, facts.arch, facts.dtype
        self.device, self.plan, self.num_blocks = facts.device, facts.plan, facts.num_blocks
        self.vocab_size = facts.vocab_size


class CoreClient:
    def __init__(self, cfg):
        self.cfg = cfg
        n = cfg.parallel.data_parallel_size
        self._dir = tempfile.mkdtemp(prefix="minillm-ipc-")
        self._ctx = zmq.Context()
        self._out = self._socket(zmq.PULL, f"ipc://{self._dir}/out")
        self._inputs = [self._socket(zmq.PUSH, f"ipc://{self._dir}/in-{i}") for i in range(n)]
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        mp = multiprocessing.get_context("spawn")
        # Not daemonic: a core may start tensor-parallel ranks of its own; close() and the cores' parent-death
        # check end them instead.
        self._procs = [mp.Process(target=run_engine_core, name=f"minillm-core-{i}",
                                  args=(replica_config(cfg, i), i, f"ipc://{self._dir}/in-{i}",
                                        f"ipc://{self._dir}/out", os.getpid())) for i in range(n)]
        self._finalizer = weakref.finalize(self, _shutdown, self._procs, self._inputs + [self._out], self._ctx,
                                           self._dir, (self._wake_r, self._wake_w))
        for p in self._procs:
            p.start()
        self._poller = zmq.Poller()
        self._poller.register(self._out, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._sentinels = {p.sentinel: i for i, p in enumerate(self._procs)}
        for fd in self._sentinels:
            self._poller.register(fd, zmq.POLLIN)
        self._live: dict[str, int] = {}          # request id -> its replica, until its final output
        self._buffer: list[CoreOutput] = []       # arrived, not yet returned
        self._stats = [EngineStats(0, 0, 0.0, 0)] * n
        self._balancer = LeastLoaded(n)
        self.dead: str | None = None
        self._lost: set[int] = set()            # replicas that died while others serve on
        self._ready = False
        try:
            facts = self._wait_ready(n)
        except BaseException:
            self.close()
            raise
        self.runner = _Remote(facts[0])
        self.max_model_len = min(f.max_model_len for f in facts)
        self.num_blocks = min(f.num_blocks for f in facts)
        self.block_size = facts[0].block_size
        self._ready = True

    def _socket(self, kind: int, addr: str):
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        # No high-water mark: a send never blocks (on a core that is dead, or busy with a long step); what waits
        # is bounded by the front end's own admission control (--max-waiting).
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.bind(addr)
        return sock

    def _wait_ready(self, n: int) -> list:
        facts = [None] * n
        while any(f is None for f in facts):
            for msg in self._receive(block=True):
                if isinstance(msg, Ready):
                    facts[msg.replica] = pickle.loads(msg.facts)
                elif isinstance(msg, Failed):
                    raise _startup_error(msg.message)
        return facts

    # ---- the EngineCore interface LLMEngine uses ----------------------------------------------------------
    def add_request(self, req) -> None:
        """Check the request fits (ValueError otherwise, as the scheduler says it), pick a replica, send it."""
        self._check_alive()
        rid, num_prompt, max_tokens = req.request_id, req.num_prompt_tokens, req.sampling_params.max_tokens
        if rid in self._live:
            raise ValueError(f"request_id {rid!r} is already in use by an unfinished request")
        if num_prompt == 0:
            raise ValueError(f"request {rid!r}: prompt is empty; it needs at least 1 token")
        if num_prompt + max_tokens > self.max_model_len:
            raise ValueError(f"request {rid!r}: prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = "
                             f"{num_prompt + max_tokens} exceeds max_model_len={self.max_model_len}")
        need = -(-(num_prompt + max_tokens - 1) // self.block_size)
        if need > self.num_blocks:
            raise ValueError(f"request {rid!r}: prompt + max_tokens needs {need} KV blocks of {self.block_size} "
                             f"tokens, but the whole KV pool has {self.num_blocks}")
        replica = self._balancer.choose(req.prompt_token_ids) if len(self._inputs) > 1 else 0
        self._inputs[replica].send(encoder.encode(AddRequest(rid, req.prompt_token_ids, req.sampling_params,
                                                             list(req.eos_token_ids), req.priority)))
        self._live[rid] = replica

    def finish_requests(self, req_ids, status) -> list[str]:
        by_replica: dict[int, list[str]] = {}
        for rid in req_ids:
            replica = self._live.pop(rid, None)
            if replica is not None:
                by_replica.setdefault(replica, []).append(rid)
        if self.dead is None:
            for replica, ids in by_replica.items():
                if replica in self._lost:
                    continue
                self._inputs[replica].send(encoder.encode(FinishRequests(ids, status.value)))
        return [rid for ids in by_replica.values() for rid in ids]

    def has_unfinished_requests(self) -> bool:
        return bool(self._live) or bool(self._buffer)

    def step(self) -> list[CoreOutput]:
        """What the cores reported since the last call; waits for something while requests are live (or until
        wake())."""
        self._take(self._receive(block=bool(self._live) and not self._buffer))
        outs, self._buffer = self._buffer, []
        return outs

    def drain(self) -> list[CoreOutput]:
        """Whatever has already arrived, without waiting."""
        if self.dead is not None:
            return []
        self._take(self._receive(block=False))
        outs, self._buffer = self._buffer, []
        return outs

    def wake(self) -> None:
        """Make a step() that waits return now (safe from any thread)."""
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):   # already awake, or closed
            pass

    def stats(self) -> EngineStats:
        s = self._stats
        if len(s) == 1:
            return s[0]
        return EngineStats(sum(x.num_running for x in s), sum(x.num_waiting for x in s),
                           sum(x.kv_cache_usage for x in s) / len(s), sum(x.num_preemptions for x in s))

    def replica_stats(self) -> list[EngineStats]:
        return list(self._stats)

    # ---- messages -----------------------------------------------------------------------------------------
    def _receive(self, block: bool, wait_ms: int | None = None) -> list:
        """Decoded messages that have arrived; with `block`, wait for at least one (or a wake-up; at most
        wait_ms if given). A replica that died raises EngineDeadError or RequestsFailed (see _died)."""
        msgs = []
        timeout = (wait_ms if block else 0)
        while True:
            events = dict(self._poller.poll(timeout))
            if not events:
                return msgs
            if self._wake_r in events:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            while True:
                try:
                    data = self._out.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msgs.append(from_core.decode(data))
            if msgs and not self._ready:   # why a core failed to start comes before its exit
                return msgs                 # (its sentinel stays readable for the next call)
            fired = [(fd, index) for fd, index in self._sentinels.items() if fd in events]
            if fired:
                self._take(msgs)   # what the other replicas said is kept (buffered for the next step)
                self._died(*fired[0])
            if msgs or self._wake_r in events or not block:
                return msgs

    def _take(self, msgs: list) -> None:
        live, buffer = self._live, self._buffer
        for msg in msgs:
            if isinstance(msg, StepOutputs):
                self._stats[msg.replica] = msg.stats
                self._balancer.report(msg.replica, msg.load_tokens)
                for out in msg.outputs:
                    if out.request_id in live:
                        buffer.append(out)
                        if out.finish_reason is not None:
                            del live[out.request_id]
            elif isinstance(msg, Rejected):
                log.error("engine core %d refused request %s: %s", msg.replica, msg.request_id, msg.message)
                if live.pop(msg.request_id, None) is not None:
                    buffer.append(CoreOutput(msg.request_id, [], "abort"))
            elif isinstance(msg, Failed):
                for rid in msg.request_ids:
                    live.pop(rid, None)
                raise RuntimeError(msg.message)

    def _died(self, fd: int, index: int) -> None:
        """A core exited. With other replicas alive (and the engine started), its requests fail
        (RequestsFailed) and the others serve on; otherwise the engine is dead (EngineDeadError)."""
        self._procs[index].join(1.0)   # its sentinel fired: it has exited, reap it for the exit code
        message = f"engine core process {index} exited (exit code {self._procs[index].exitcode})"
        self._poller.unregister(fd)
        del self._sentinels[fd]
        self._lost.add(index)
        if not self._ready or len(self._lost) == len(self._procs):
            self.dead = message
            self._live.clear()
            raise EngineDeadError(message)
        log.error("%s; its requests fail, the other replicas serve on", message)
        self._balancer.remove(index)
        self._stats[index] = EngineStats(0, 0, 0.0, self._stats[index].num_preemptions)
        lost = [rid for rid, replica in self._live.items() if replica == index]
        for rid in lost:
            del self._live[rid]
        raise RequestsFailed(message, lost)

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)

    def check(self, timeout_s: float = 0.0) -> None:
        """Read what has arrived (waiting up to timeout_s for something, or a wake-up); raise EngineDeadError if
        the engine is dead. For an idle front end: nothing is live, so a replica lost meanwhile fails nobody."""
        self._check_alive()
        try:
            self._take(self._receive(block=timeout_s > 0, wait_ms=int(timeout_s * 1000)))
        except RequestsFailed as e:
            if e.request_ids:
                raise

    def close(self) -> None:
        self._finalizer()


def _startup_error(message: str) -> BaseException:
    if message.startswith("pickle:"):
        try:
            return pickle.loads(bytes.fromhex(message[7:]))
        except Exception:  # noqa: BLE001
            pass
    return RuntimeError(f"the engine core failed to start: {message}")


def _shutdown(procs, sockets, ctx, directory: str, fds) -> None:
    """Say Shutdown to every live core, join them (kill what does not exit), close the sockets, remove the
    socket directory."""
    for proc, sock in zip(procs, sockets):
        if proc.is_alive():
            try:
                sock.send(encoder.encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
    for proc in procs:
        if proc.pid is None:
            continue
        proc.join(_JOIN_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join(_JOIN_TIMEOUT_S)
        proc.close()
    for sock in sockets:
        sock.close(0)
    ctx.term()
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    shutil.rmtree(directory, ignore_errors=True)

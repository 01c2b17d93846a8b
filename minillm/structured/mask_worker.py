"""The grammar matchers in processes of their own (`structured.mask_worker` true), so that a step's accepts and
fills run beside the engine's host work. The default (mask_thread.py) runs them on a thread of the engine's
process instead, which skips this path's pickling, pipe round trip and bitmask copy.

    engine process (GrammarRows)                         worker process k of structured.mask_workers (Matchers)
    open / drop (a request's grammar, its end)   --->    compile (its own cache), matcher / forget
    fill (turn, [RowWork])                       --->    advance, fill its rows of shared buffer `turn`, min_tokens
    wait (turn)                                  <---    filled
    ring (turn, seq), in shared memory           --->    the steady step: its rows' new tokens from shared memory

Each request belongs to one worker (the least loaded when it opens), so a step's accepts and fills are split
over the workers, which fill their rows of the one shared buffer side by side: the step's critical path is its
largest share, not the whole batch. The bitmasks travel in shared memory (two buffers used in turn), the
messages over a pipe per worker. Every worker gets every fill (an empty one if it owns no row of the step); one
sent with a sequence number > 0 also stores it in the worker's flag for `turn` in the same memory once its rows
are written (its negative if the fill failed): a CUDA stream waiting on every worker's flag (GrammarRows,
mask_wait auto) needs no answer from the host. A worker exits when told, when its pipe closes, or when its
parent is gone; one that dies or does not answer in time fails the step that waits for it (RuntimeError), which
the engine answers as any failed step.

A steady decode step (the same rows as the fill before, each one output further: GrammarRows.masks decides)
costs the engine no message: it stores the fill's sequence number in the shared ring, the GPU stores the tokens
the step before sampled in shared memory behind its sampler (GrammarRows.publish), and each worker, polling
the ring, waits for those tokens and builds its rows' work itself (Matchers.fill_next). It answers in its flag
alone (with a message only if it failed). A pipe message costs the engine's thread ~40 us, mostly waking the
reader, and the per-row work as much again at 64 rows. So a worker spins on the ring and the pipe for _SPIN_S
after its last work; past that it sleeps on its pipe, having said so in shared memory (`sleeping`), and a ring
sends it a wake message. Both sides store, then fence, then load (memory_barrier): a ring is never missed.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import time
import weakref
from multiprocessing import shared_memory
from types import SimpleNamespace

import numpy as np

from minillm.config import StructuredConfig
from minillm.structured.matchers import memory_barrier, publish_flag

_POLL_S = 0.5          # an idle worker checks on its parent this often
_SPIN_S = 0.005        # a worker polls without sleeping this long after its last work: a few decode steps


class MaskWorker:
    def __init__(self, model_dir, vocab_size: int, cfg: StructuredConfig, max_rows: int):
        words = (vocab_size + 31) // 32
        n = cfg.mask_workers
        self.shape = (2, max_rows, words)
        head = _head_bytes(n, max_rows)
        self.shm = shared_memory.SharedMemory(create=True, size=head + int(np.prod(self.shape)) * 4)
        self.shared = _views(self.shm, n, self.shape)
        self.flags, self.buffers = self.shared.flags, self.shared.buffers
        # A fill waits at most this long: a new grammar compiles in the worker first (bounded by the same limit).
        self.timeout_s = 2 * cfg.compile_timeout_s + 10.0
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for k in range(n):
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, name=f"minillm-grammar-masks-{k}", daemon=True,
                               args=(child, k, n, model_dir, vocab_size, cfg, self.shm.name, self.shape, os.getpid()))
            proc.start()
            child.close()
            self.conns.append(conn)
            self.procs.append(proc)
        self.owner: dict[str, int] = {}    # live request -> the worker holding its matcher
        self._load = [0] * n
        # Run before the shared memory is unmapped, whether close() or the garbage collector ends the workers: a
        # CUDA registration of that memory must not outlive the mapping (a later mapping at the same address would
        # find the range registered, to pages that are gone).
        self.before_unmap: list = []
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self.conns, self.shm, self.before_unmap)

    def open(self, req_id: str, spec, banned: tuple[int, ...], eos_ids: tuple[int, ...], min_tokens: int = 0) -> None:
        k = self.owner.get(req_id)
        if k is None:
            k = min(range(len(self._load)), key=self._load.__getitem__)
            self.owner[req_id] = k
            self._load[k] += 1
        self._send(k, ("open", req_id, spec, banned, eos_ids, min_tokens))

    def drop(self, req_ids) -> None:
        groups: dict[int, list[str]] = {}
        for rid in req_ids:
            k = self.owner.pop(rid, None)
            if k is not None:
                self._load[k] -= 1
                groups.setdefault(k, []).append(rid)
        for k, rids in groups.items():
            self._send(k, ("drop", rids))

    def fill(self, turn: int, work, out: np.ndarray, seq: int = 0) -> None:
        """Start filling shared buffer `turn` for `work`, each worker its own requests' rows; wait(turn, out)
        copies the rows into `out` (nothing to copy where `out` is that buffer). seq > 0: each worker stores it in
        its flag for `turn` when its rows are in."""
        if len(self.procs) == 1:
            shares = [work]
        else:
            shares = [[] for _ in self.procs]
            for w in work:   # RowWork layout: w[1] is the request id
                shares[self.owner.get(w[1], 0)].append(w)
        for k, share in enumerate(shares):
            self._send(k, ("fill", turn, share, seq))

    def ring(self, turn: int, seq: int) -> None:
        """Start steady fill `seq` of buffer `turn`: each worker follows on from its last fill (Matchers.fill_next)
        with the tokens GrammarRows.publish stores for fill seq - 1. settle_ring(turn, seq) waits for it."""
        ring = self.shared.ring
        ring[1] = turn
        publish_flag(ring, 0, seq)
        memory_barrier()   # the ring's store before the loads of `sleeping`; the worker fences the other way
        for k in np.flatnonzero(self.shared.sleeping):
            self._send(int(k), ("wake",))

    def settle_ring(self, turn: int, seq: int) -> None:
        """Return once every worker's flag for `turn` says steady fill `seq` is in; raise what went wrong if one
        failed (its message), exited, or took longer than timeout_s."""
        flags = self.flags[:, turn]
        end, wait = None, 0.0
        while not (flags == seq).all():
            failed = np.flatnonzero(flags == -seq)
            if len(failed):
                errors = [self._answer(int(k), turn) for k in failed]
                raise RuntimeError(next((e for e in errors if e), "the grammar mask worker failed a fill"))
            dead = next((p for p in self.procs if not p.is_alive()), None)
            if dead is not None:
                raise RuntimeError(f"the grammar mask worker exited (exit code {dead.exitcode})")
            now = time.monotonic()
            end = end or now + self.timeout_s
            if now > end:
                raise RuntimeError(f"the grammar mask worker did not finish a fill within {self.timeout_s:g} s")
            time.sleep(wait)
            wait = min(1e-3, wait + 5e-5)

    def wait(self, turn: int, out: np.ndarray) -> np.ndarray:
        """`out`, once every worker says buffer `turn` is filled and its rows are copied into it. Every answer is
        read, even after a failure, so the next fill's answers are the next ones read."""
        errors = [e for e in (self._answer(k, turn) for k in range(len(self.procs))) if e]
        if errors:
            raise RuntimeError(errors[0])
        if out.ctypes.data != self.buffers[turn].ctypes.data:
            out[:] = self.buffers[turn, :len(out)]
        return out

    def _answer(self, k: int, turn: int) -> str | None:
        """Worker k's answer to the fill of `turn`: None when filled, else what went wrong."""
        conn, proc = self.conns[k], self.procs[k]
        if not conn.poll(self.timeout_s):
            return f"the grammar mask worker did not answer within {self.timeout_s:g} s"
        try:
            reply = conn.recv()
        except EOFError:
            return f"the grammar mask worker exited (exit code {proc.exitcode})"
        if reply[0] == "error":
            return f"the grammar mask worker failed: {reply[1]}"
        if reply != ("filled", turn):
            return f"the grammar mask worker answered {reply!r}, expected buffer {turn}"
        return None

    def close(self) -> None:
        self._finalizer()

    def _send(self, k: int, msg) -> None:
        try:
            self.conns[k].send(msg)
        except (BrokenPipeError, OSError):
            raise RuntimeError(f"the grammar mask worker exited (exit code {self.procs[k].exitcode})") from None


def _shutdown(procs, conns, shm, before_unmap) -> None:
    for conn in conns:
        try:
            conn.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
    for proc in procs:
        proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)
    for conn in conns:
        conn.close()
    for hook in before_unmap:
        try:
            hook()
        except Exception as e:  # noqa: BLE001 - at interpreter exit CUDA may be gone; the segment must still go
            print(f"minillm: grammar mask worker: {type(e).__name__}: {e}", file=sys.stderr)
    before_unmap.clear()
    shm.close()
    shm.unlink()


def _serve(conn, k: int, n: int, model_dir, vocab_size: int, cfg: StructuredConfig, shm_name: str, shape,
           parent_pid: int) -> None:
    """Worker k's loop: apply each message in order, and each ring once every message before it is applied; a
    message fill answers ("filled", turn) or ("error", text), a ring only if it failed."""
    import signal

    from minillm.structured.matchers import Matchers

    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the process group: the engine stops us
    shm = shared_memory.SharedMemory(name=shm_name)
    shared = _views(shm, n, shape)
    matchers = Matchers(model_dir, vocab_size, cfg)
    errors: list[str] = []   # what failed outside a fill (an open): the next fill answers with it
    ring, sleeping = shared.ring, shared.sleeping
    done = 0                 # the sequence number of the last fill done (message or ring)
    try:
        spin_until = time.monotonic() + _SPIN_S
        while True:
            if conn.poll(0):
                try:
                    msg = conn.recv()
                except EOFError:
                    return
                if msg[0] == "stop":
                    return
                done = _apply(matchers, shared, k, msg, conn, errors) or done
            elif ring[0] == done + 1:   # a ring past the next fill waits for that fill's message
                memory_barrier()
                if conn.poll(0):   # a message sent before the ring, after the poll above: it goes first
                    continue
                done += 1
                _follow(matchers, shared, k, done, int(ring[1]), conn, errors, 2 * cfg.compile_timeout_s + 10.0)
            elif time.monotonic() < spin_until:
                continue
            elif not _sleep(conn, sleeping, k, ring, done, parent_pid):
                return
            spin_until = time.monotonic() + _SPIN_S
    finally:
        del shared, ring, sleeping
        shm.close()


def _sleep(conn, sleeping: np.ndarray, k: int, ring: np.ndarray, done: int, parent_pid: int) -> bool:
    """Block on the pipe until a message (a ring sends a wake), or _POLL_S; False once the parent is gone."""
    sleeping[k] = 1
    memory_barrier()   # the store of `sleeping` before the ring's load; ring() fences the other way
    try:
        if ring[0] != done + 1 and not conn.poll(_POLL_S):
            return os.getppid() == parent_pid
        return True
    finally:
        sleeping[k] = 0


def _head_bytes(n: int, max_rows: int) -> int:
    """The int64 words before the bitmasks (flags [n, 2], ring [2], sleeping [n], token flags [2], tokens
    [2, max_rows]), rounded to 64 bytes."""
    return ((n * 2 + 2 + n + 2 + 2 * max_rows) * 8 + 63) // 64 * 64


def _views(shm, n: int, shape) -> SimpleNamespace:
    """The shared memory's parts: `flags` int64 [n workers, 2 turns] (each fill's sequence number, per worker;
    at the start, which GrammarRows registers with CUDA), the `ring` int64 [seq, turn] of the last steady fill,
    `sleeping` int64 [n], `token_flags` int64 [2] and `tokens` int64 [2, max_rows] (GrammarRows.publish: fill
    s's sampled tokens in slot s % 2, then s in token_flags[s % 2]), and the bitmask buffers int32 `shape`."""
    max_rows = shape[1]
    words = np.ndarray((_head_bytes(n, max_rows) // 8,), dtype=np.int64, buffer=shm.buf)
    parts, at = {}, 0
    for name, size in (("flags", 2 * n), ("ring", 2), ("sleeping", n), ("token_flags", 2), ("tokens", 2 * max_rows)):
        parts[name], at = words[at:at + size], at + size
    parts["flags"] = parts["flags"].reshape(n, 2)
    parts["tokens"] = parts["tokens"].reshape(2, max_rows)
    parts["buffers"] = np.ndarray(shape, dtype=np.int32, buffer=shm.buf, offset=_head_bytes(n, max_rows))
    return SimpleNamespace(**parts)


def _apply(matchers, shared, k: int, msg, conn, errors: list[str]) -> int:
    """Apply one message; a fill's sequence number once it is done (else 0)."""
    kind = msg[0]
    try:
        if kind == "open":
            matchers.open(*msg[1:])
        elif kind == "drop":
            matchers.drop(msg[1])
        elif kind == "fill":
            if errors:
                raise RuntimeError("; ".join(errors))
            turn, work, seq = msg[1], msg[2], msg[3]
            matchers.fill(work, shared.buffers[turn])   # rows are the step's: this worker writes only its own
            if seq:
                publish_flag(shared.flags[k], turn, seq)   # a stream waiting on it goes on
            conn.send(("filled", turn))
            return seq
    except Exception as e:  # noqa: BLE001 - the waiting step fails with this text; the worker serves on
        if kind == "fill":
            if msg[3]:
                publish_flag(shared.flags[k], msg[1], -msg[3])
            errors.clear()
            conn.send(("error", f"{type(e).__name__}: {e}"))
            return msg[3]
        errors.append(f"{kind}: {type(e).__name__}: {e}")
    return 0   # "wake" needs nothing


def _follow(matchers, shared, k: int, seq: int, turn: int, conn, errors: list[str], timeout_s: float) -> None:
    """Steady fill `seq` of buffer `turn`: wait for the tokens of fill seq - 1 (the GPU stores them behind that
    step's sampler), fill this worker's rows from them, then the flag; on failure -seq and a message."""
    try:
        if errors:
            raise RuntimeError("; ".join(errors))
        slot = (seq - 1) % 2
        _await_flag(shared.token_flags, slot, seq - 1, timeout_s)
        matchers.fill_next(shared.tokens[slot], shared.buffers[turn])
        publish_flag(shared.flags[k], turn, seq)
    except Exception as e:  # noqa: BLE001 - as _apply
        publish_flag(shared.flags[k], turn, -seq)
        errors.clear()
        conn.send(("error", f"{type(e).__name__}: {e}"))


def _await_flag(flags: np.ndarray, i: int, value: int, timeout_s: float) -> None:
    """Return once flags[i] == value (a spin for the first 2 ms, then short sleeps), after a barrier: what was
    stored before the flag is seen. Raise after timeout_s."""
    start = None
    while flags[i] != value:
        now = time.monotonic()
        start = start or now
        if now - start > timeout_s:
            raise RuntimeError(f"the sampled tokens of fill {value} did not arrive within {timeout_s:g} s")
        if now - start > 0.002:
            time.sleep(1e-4)
    memory_barrier()

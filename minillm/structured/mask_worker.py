"""The grammar matchers in processes of their own (`structured.mask_worker` true), so that a step's accepts and
fills run beside the engine's host work. The default (mask_thread.py) runs them on a thread of the engine's
process instead, which skips this path's pickling, pipe round trip and bitmask copy.

    engine process (GrammarRows)                         worker process k of structured.mask_workers (Matchers)
    open / drop (a request's grammar, its end)   --->    compile (its own cache), matcher / forget
    fill (turn, [RowWork])                       --->    advance, fill its rows of shared buffer `turn`, min_tokens
    wait (turn)                                  <---    filled

Each request belongs to one worker (the least loaded when it opens), so a step's accepts and fills are split
over the workers, which fill their rows of the one shared buffer side by side: the step's critical path is its
largest share, not the whole batch. The bitmasks travel in shared memory (two buffers used in turn), the
messages over a pipe per worker. Every worker gets every fill (an empty one if it owns no row of the step); one
sent with a sequence number > 0 also stores it in the worker's flag for `turn` in the same memory once its rows
are written (its negative if the fill failed): a CUDA stream waiting on every worker's flag (GrammarRows,
mask_wait auto) needs no answer from the host. A worker exits when told, when its pipe closes, or when its
parent is gone; one that dies or does not answer in time fails the step that waits for it (RuntimeError), which
the engine answers as any failed step.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import weakref
from multiprocessing import shared_memory

import numpy as np

from minillm.config import StructuredConfig
from minillm.structured.matchers import publish_flag

_POLL_S = 0.5          # an idle worker checks on its parent this often


class MaskWorker:
    def __init__(self, model_dir, vocab_size: int, cfg: StructuredConfig, max_rows: int):
        words = (vocab_size + 31) // 32
        n = cfg.mask_workers
        self.shape = (2, max_rows, words)
        head = _flags_bytes(n)
        self.shm = shared_memory.SharedMemory(create=True, size=head + int(np.prod(self.shape)) * 4)
        self.flags, self.buffers = _views(self.shm, n, self.shape)
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

    def open(self, req_id: str, spec, banned: tuple[int, ...], eos_ids: tuple[int, ...]) -> None:
        k = self.owner.get(req_id)
        if k is None:
            k = min(range(len(self._load)), key=self._load.__getitem__)
            self.owner[req_id] = k
            self._load[k] += 1
        self._send(k, ("open", req_id, spec, banned, eos_ids))

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
    """Worker k's loop: apply each message in order; a fill answers ("filled", turn) or ("error", text)."""
    import signal

    from minillm.structured.matchers import Matchers

    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the process group: the engine stops us
    shm = shared_memory.SharedMemory(name=shm_name)
    flags, buffers = _views(shm, n, shape)
    flags = flags[k]
    matchers = Matchers(model_dir, vocab_size, cfg)
    errors: list[str] = []   # what failed outside a fill (an open): the next fill answers with it
    try:
        while True:
            if not conn.poll(_POLL_S):
                if os.getppid() != parent_pid:
                    return
                continue
            try:
                msg = conn.recv()
            except EOFError:
                return
            if msg[0] == "stop":
                return
            _apply(matchers, buffers, flags, msg, conn, errors)
    finally:
        del buffers, flags
        shm.close()


def _flags_bytes(n: int) -> int:
    """The flags at the start of the shared memory (int64 [n workers, 2 turns]), rounded to 64 bytes."""
    return (n * 16 + 63) // 64 * 64


def _views(shm, n: int, shape) -> tuple[np.ndarray, np.ndarray]:
    """The flags (int64 [n, 2]) and the bitmask buffers (int32 `shape`) in the shared memory."""
    flags = np.ndarray((n, 2), dtype=np.int64, buffer=shm.buf)
    return flags, np.ndarray(shape, dtype=np.int32, buffer=shm.buf, offset=_flags_bytes(n))


def _apply(matchers, buffers: np.ndarray, flags: np.ndarray, msg, conn, errors: list[str]) -> None:
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
            if work:   # rows are the step's: this worker writes only its own
                matchers.fill(work, buffers[turn])
            if seq:
                publish_flag(flags, turn, seq)   # a stream waiting on it goes on
            conn.send(("filled", turn))
    except Exception as e:  # noqa: BLE001 - the waiting step fails with this text; the worker serves on
        if kind == "fill":
            if msg[3]:
                publish_flag(flags, msg[1], -msg[3])
            errors.clear()
            conn.send(("error", f"{type(e).__name__}: {e}"))
        else:
            errors.append(f"{kind}: {type(e).__name__}: {e}")

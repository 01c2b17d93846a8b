"""The grammar matchers in a process of their own (`structured.mask_worker` true), so that a step's accepts and
fills run beside the engine's host work. The default (mask_thread.py) runs them on a thread of the engine's
process instead, which skips this path's pickling, pipe round trip and bitmask copy.

    engine process (GrammarRows)                         worker process (Matchers)
    open / drop (a request's grammar, its end)   --->    compile (its own cache), matcher / forget
    fill (turn, [RowWork])                       --->    advance, fill rows of shared buffer `turn`, min_tokens
    wait (turn)                                  <---    filled

The bitmasks travel in shared memory (two buffers used in turn), the messages over a pipe. A fill sent with a
sequence number > 0 also stores it in flag `turn` of the same memory once the rows are written (its negative if
the fill failed): a CUDA stream waiting on that flag (GrammarRows, mask_wait auto) needs no answer from the host.
The worker exits when told, when the pipe closes, or when its parent is gone; a worker that dies or does not
answer in time fails the step that waits for it (RuntimeError), which the engine answers as any failed step.
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
_FLAGS_BYTES = 64      # the two int64 flags at the start of the shared memory, the bitmasks after them


class MaskWorker:
    def __init__(self, model_dir, vocab_size: int, cfg: StructuredConfig, max_rows: int):
        words = (vocab_size + 31) // 32
        self.shape = (2, max_rows, words)
        self.shm = shared_memory.SharedMemory(create=True, size=_FLAGS_BYTES + int(np.prod(self.shape)) * 4)
        self.flags, self.buffers = _views(self.shm, self.shape)
        # A fill waits at most this long: a new grammar compiles in the worker first (bounded by the same limit).
        self.timeout_s = 2 * cfg.compile_timeout_s + 10.0
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, name="minillm-grammar-masks", daemon=True,
                                args=(child, model_dir, vocab_size, cfg, self.shm.name, self.shape, os.getpid()))
        self.proc.start()
        child.close()
        # Run before the shared memory is unmapped, whether close() or the garbage collector ends the worker: a
        # CUDA registration of that memory must not outlive the mapping (a later mapping at the same address would
        # find the range registered, to pages that are gone).
        self.before_unmap: list = []
        self._finalizer = weakref.finalize(self, _shutdown, self.proc, self.conn, self.shm, self.before_unmap)

    def open(self, req_id: str, spec, banned: tuple[int, ...], eos_ids: tuple[int, ...]) -> None:
        self._send(("open", req_id, spec, banned, eos_ids))

    def drop(self, req_ids) -> None:
        self._send(("drop", list(req_ids)))

    def fill(self, turn: int, work, out: np.ndarray, seq: int = 0) -> None:
        """Start filling shared buffer `turn` for `work`; wait(turn, out) copies the rows into `out` (nothing to
        copy where `out` is that buffer). seq > 0: the worker stores it in flags[turn] when the rows are in."""
        self._send(("fill", turn, work, seq))

    def wait(self, turn: int, out: np.ndarray) -> np.ndarray:
        """`out`, once the worker says buffer `turn` is filled and its rows are copied into it."""
        if not self.conn.poll(self.timeout_s):
            raise RuntimeError(f"the grammar mask worker did not answer within {self.timeout_s:g} s")
        try:
            reply = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the grammar mask worker exited (exit code {self.proc.exitcode})") from None
        if reply[0] == "error":
            raise RuntimeError(f"the grammar mask worker failed: {reply[1]}")
        if reply != ("filled", turn):
            raise RuntimeError(f"the grammar mask worker answered {reply!r}, expected buffer {turn}")
        if out.ctypes.data != self.buffers[turn].ctypes.data:
            out[:] = self.buffers[turn, :len(out)]
        return out

    def close(self) -> None:
        self._finalizer()

    def _send(self, msg) -> None:
        try:
            self.conn.send(msg)
        except (BrokenPipeError, OSError):
            raise RuntimeError(f"the grammar mask worker exited (exit code {self.proc.exitcode})") from None


def _shutdown(proc, conn, shm, before_unmap) -> None:
    try:
        conn.send(("stop",))
    except (BrokenPipeError, OSError):
        pass
    proc.join(2.0)
    if proc.is_alive():
        proc.kill()
        proc.join(2.0)
    conn.close()
    for hook in before_unmap:
        try:
            hook()
        except Exception as e:  # noqa: BLE001 - at interpreter exit CUDA may be gone; the segment must still go
            print(f"minillm: grammar mask worker: {type(e).__name__}: {e}", file=sys.stderr)
    before_unmap.clear()
    shm.close()
    shm.unlink()


def _serve(conn, model_dir, vocab_size: int, cfg: StructuredConfig, shm_name: str, shape, parent_pid: int) -> None:
    """The worker's loop: apply each message in order; a fill answers ("filled", turn) or ("error", text)."""
    import signal

    from minillm.structured.matchers import Matchers

    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the process group: the engine stops us
    shm = shared_memory.SharedMemory(name=shm_name)
    flags, buffers = _views(shm, shape)
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


def _views(shm, shape) -> tuple[np.ndarray, np.ndarray]:
    """The flags (int64 [2]) and the bitmask buffers (int32 `shape`) in the shared memory."""
    flags = np.ndarray((2,), dtype=np.int64, buffer=shm.buf)
    return flags, np.ndarray(shape, dtype=np.int32, buffer=shm.buf, offset=_FLAGS_BYTES)


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
            matchers.fill(work, buffers[turn, :len(work)])
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

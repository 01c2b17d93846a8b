"""The grammar matchers on one thread of the engine's process (the default; `structured.mask_worker` false).

xgrammar releases the GIL while it accepts tokens and fills bitmask rows, so a step's fill runs on this thread
while the engine thread goes on with its own host work (resolving the step before, scheduling, building the
next step's inputs) and waits only when it launches the step's sampler (GrammarRows.finish). Every call to the
matchers goes through the one thread, in the order made, so opens and drops never race a fill.

Same interface as MaskWorker (mask_worker.py), without the copies: the rows are filled in place in the buffer
the caller passes. A failed open or drop fails the next fill that is waited for, as in the worker. A fill with a
sequence number > 0 stores it in `flags[turn]` when its rows are written (its negative if it failed), as the
worker does for a CUDA stream waiting on the flag.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from minillm.config import StructuredConfig
from minillm.structured.matchers import Matchers, publish_flag


class MaskThread:
    def __init__(self, model_dir, vocab_size: int, cfg: StructuredConfig, flags: np.ndarray | None = None):
        self.matchers = Matchers(model_dir, vocab_size, cfg)
        self.flags = flags   # int64 [2], where fills with a sequence number say they are done
        # As MaskWorker.timeout_s: the host gives up on a fill before a stream waiting for it does.
        self.timeout_s = 2 * cfg.compile_timeout_s + 10.0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="minillm-grammar-masks")
        self._changes: list[tuple[str, Future]] = []   # opens and drops not yet checked
        self._fills: dict[int, Future] = {}

    def open(self, req_id: str, spec, banned: tuple[int, ...], eos_ids: tuple[int, ...], min_tokens: int = 0) -> None:
        self._changes.append(("open", self._pool.submit(self.matchers.open, req_id, spec, banned, eos_ids,
                                                        min_tokens)))

    def drop(self, req_ids) -> None:
        self._changes.append(("drop", self._pool.submit(self.matchers.drop, list(req_ids))))

    def fill(self, turn: int, work, out: np.ndarray, seq: int = 0) -> None:
        """Start filling `out` (the step's rows) for `work`; wait(turn) returns once it is done."""
        self._fills[turn] = self._pool.submit(self._fill, turn, work, out, seq)

    def _fill(self, turn: int, work, out: np.ndarray, seq: int) -> None:
        try:
            self.matchers.fill(work, out)
        except BaseException:
            if seq:
                publish_flag(self.flags, turn, -seq)
            raise
        if seq:
            publish_flag(self.flags, turn, seq)

    def wait(self, turn: int, out: np.ndarray) -> np.ndarray:
        fut = self._fills.pop(turn, None)
        if fut is None:
            raise RuntimeError(f"no grammar mask fill is pending for buffer {turn}")
        try:
            fut.result(self.timeout_s)
        except FutureTimeout:
            raise RuntimeError(f"the grammar mask thread did not finish a fill within {self.timeout_s:g} s") from None
        # The changes queued before this fill have run by now: report the first that failed.
        done = [(kind, f) for kind, f in self._changes if f.done()]
        self._changes = [(kind, f) for kind, f in self._changes if not f.done()]
        for kind, f in done:
            if f.exception() is not None:
                e = f.exception()
                raise RuntimeError(f"grammar matcher {kind} failed: {type(e).__name__}: {e}")
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

"""The runner's side of structured outputs: which rows of a step are constrained, what their matchers must be
told (RowWork: minillm/structured/matchers.py), and the step's bitmask on the logits' device.

Before a step samples a constrained row, its matcher is brought to exactly the outputs that precede the token
sampled now (the row's position says how many). Recomputation after preemption and prefix hits change no output
token, so they leave the matcher where it is.

Async scheduling: step N+1 is launched while step N's tokens are still on the device. The forward pass of N+1 is
queued first (it takes N's tokens from the device); only before N+1's sampler does the host wait for N's tokens
(which the GPU finished before N+1's forward began) and hand the rows' work over. Steps without a constrained row
never wait.

Where the matchers run: on a thread of this process (mask_thread.py) or in a worker process (mask_worker.py,
`structured.mask_worker`, the default on CUDA). Either way masks() hands the step's work over and returns at once,
in one of two ways (`gpu_wait`, StructuredConfig.gpu_waits_for_masks):
- gpu_wait (CUDA): it queues, on a stream of its own, a wait for the fill's flags in mapped host memory (each
  filler, the thread or a worker process, stores the step's sequence number in its own flag once its rows are
  written: cuda/grammar_mask.cu), then the bitmask's copy to the device, and returns a FencedMask: the runner
  queues the sampler behind that copy, so the copy runs during the forward pass as soon as the fill is in and
  the sampler starts right after the forward, whatever the host is doing. Before
  the host waits for that step's tokens it settles the fence: it takes the filler's answer, and on any failure
  stores the flags' negative itself (the stream goes on) and raises, so a dead worker fails the step and never
  hangs the stream (the wait is also bounded in time). With a worker process, a steady decode step (the rows of
  the step before, each one output further) is handed over without a message or any per-row work
  (_follows, mask_worker.py): the GPU stores each fenced step's tokens in the worker's memory behind its
  sampler (publish), and the next step's fill follows on from them;
- otherwise it returns a PendingMask, and the runner launches the step's sampler only when the next step is
  launched or this one resolved (model_runner.py): the fills run beside the host work of that interval.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from operator import is_

import torch

from minillm.config import StructuredConfig
from minillm.sampling.grammar_mask import (GrammarMask, publish_host_tokens, register_host_memory,
                                           unregister_host_memory, wait_for_host_flag)


@dataclass
class PendingMask:
    """A step's bitmask that a worker process is filling; result() waits for it (GrammarMask on the device)."""
    rows: "GrammarRows"
    turn: int
    n: int
    index: list[int] | None          # the constrained rows' indices; None: every row, in order

    def result(self) -> GrammarMask:
        return self.rows.finish(self)


@dataclass
class MaskFence:
    """The host's side of a step whose stream waits for its bitmask: settle() before waiting for its tokens."""
    rows: "GrammarRows"
    turn: int
    seq: int
    ring: bool = False   # a steady fill: the workers answer in their flags (MaskWorker.settle_ring)

    def settle(self) -> None:
        self.rows.settle(self)


@dataclass
class FencedMask:
    """A step's bitmask whose copy to the device is queued behind a wait for its fill (gpu_wait)."""
    mask: GrammarMask
    fence: MaskFence


class GrammarRows:
    def __init__(self, model_dir, vocab_size: int, cfg: StructuredConfig, device: torch.device,
                 max_rows: int, defer: bool = True, worker: bool = False, gpu_wait: bool = False):
        self.model_dir, self.vocab_size, self.cfg, self.device = model_dir, vocab_size, cfg, device
        self.max_rows = max_rows
        self.worker = worker   # the matchers in a process of their own (StructuredConfig.matchers_in_worker)
        self.defer = defer   # False: masks() waits for the fill (tensor parallel: rank 0 keeps its collectives' order)
        self.sent: dict[str, int] = {}          # per live constrained request: output tokens its matcher was sent
        self._worker = None
        self._host: list[torch.Tensor] = []    # two bitmask buffers used in turn (a copy may be in flight)
        self._index: list[torch.Tensor] = []   # and the constrained rows' indices
        self._turn = 0
        self.gpu_wait = gpu_wait and defer   # the stream, not the host, waits for each fill (FencedMask)
        self._seq = 0                        # the last fill's sequence number (gpu_wait)
        self._unsettled: dict[int, int] = {}   # turn -> sequence number of a fill the host has not settled
        self._flags = None                   # numpy int64 [fillers, 2] in mapped host memory, the fills' flags
        self._status = None                  # int32 CUDA [2, fillers]: how each wait ended (0 / 2 / 1: timed out)
        self._registered: int | None = None  # the worker's shared memory, registered with CUDA
        self._dev = self._dev_index = None   # gpu_wait: the bitmasks and row indices on the device, per turn
        self._copies = None                  # the stream the waits and those copies run on
        self._free: list = [None, None]      # per turn: an event behind the last sampler that read its buffers
        self._views: dict = {}               # (turn, rows) -> the view of _dev the sampler reads
        self._rows_sent: list = [None, None]   # per turn: (index list, its device copy) last copied
        self._waits = None                   # per turn: each filler's flag wait (_wait_flags)
        # What a steady step follows on from (_follows): the last fill's sampled rows (the list masks() got),
        # request ids and row indices, and the last fill whose tokens were published.
        self._last: tuple[list, list[str], list[int] | None] | None = None
        self._published = 0

    @property
    def matchers(self):
        """Where the matchers live: MaskThread or MaskWorker, started with the first constrained request."""
        if self._worker is None:
            if self.worker:
                from minillm.structured.mask_worker import MaskWorker
                self._worker = MaskWorker(self.model_dir, self.vocab_size, self.cfg, self.max_rows)
                if self.gpu_wait:
                    self._share_worker_memory(self._worker)
            else:
                from minillm.structured.mask_thread import MaskThread
                if self.gpu_wait:
                    pin = self.device.type == "cuda"
                    self._flags = torch.zeros(1, 2, dtype=torch.int64, pin_memory=pin).numpy()
                flags = None if self._flags is None else self._flags[0]
                self._worker = MaskThread(self.model_dir, self.vocab_size, self.cfg, flags)
        return self._worker

    def _share_worker_memory(self, worker) -> None:
        """The worker's shared memory is where the stream reads flags and bitmasks: register it with CUDA and
        use its buffers as ours, so the rows are copied to the device straight from where they are written."""
        addr = worker.flags.ctypes.data
        register_host_memory(addr, worker.shm.size)
        self._registered = addr
        worker.before_unmap.append(partial(_unregister, addr, self.device))   # holds no reference to self
        self._flags = worker.flags
        self._host = [torch.from_numpy(worker.buffers[t]) for t in range(2)]
        pin = self.device.type == "cuda"
        self._index = [torch.empty(self.max_rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]

    def update(self, so) -> None:
        """Follow the step's plain-data changes: a matcher for each new constrained request, none for ended ones."""
        ended = [rid for rid in so.finished_ids if self.sent.pop(rid, None) is not None]
        if ended:
            self.matchers.drop(ended)
            self._last = None
        for new in so.new_requests:
            sp = new.sampling_params
            if sp.structured is not None:
                banned = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(new.eos_token_ids))
                banned = tuple(sorted(t for t in banned if 0 <= t < self.vocab_size))
                self.matchers.open(new.req_id, sp.structured, banned, tuple(sorted(new.eos_token_ids)),
                                   sp.min_tokens)
                self.sent[new.req_id] = 0
                self._last = None

    def masks(self, sampled, seq_lens, prev, beside: bool = True) -> GrammarMask | PendingMask | None:
        """The bitmask of this step's constrained rows (None when there is none: the sampler skips masking).
        sampled: the rows' request states; seq_lens: each row's length with this step's tokens; prev: the
        launched step whose tokens have not reached the host yet (async scheduling), or None; beside (gpu_wait):
        the stream's wait for the fill may run beside the step's forward pass (_queue_waits)."""
        if not self.sent:
            return None
        if self._follows(sampled, prev):
            return self._follow(sampled, prev, beside)
        rows = [i for i, r in enumerate(sampled) if r.request_id in self.sent]
        if not rows:
            self._last = None
            return None
        work = self._work(sampled, rows, seq_lens, prev)
        index = None if len(rows) == len(sampled) else rows
        self._turn ^= 1
        if self.gpu_wait:
            self._last = (sampled, [w[1] for w in work], index) if self.worker else None
            return self._fenced(self._turn, len(work), work, index, beside)
        self.matchers.fill(self._turn, work, self._host_buffer(self._turn, len(rows)).numpy())
        pending = PendingMask(self, self._turn, len(rows), index)
        return pending if self.defer else self.finish(pending)

    def _follows(self, sampled, prev) -> bool:
        """Whether this step's constrained rows are the last fill's, each one output further, that output being
        what the step before sampled (published to the worker): the same sampled rows, in order, as the step
        launched before, which was the last fill's, with no constrained request opened or ended since."""
        last = self._last
        return (last is not None and prev is not None and prev.sampled is last[0] and self._published == self._seq
                and len(sampled) == len(last[0]) and all(map(is_, sampled, last[0])))

    def _follow(self, sampled, prev, beside: bool) -> FencedMask:
        """The steady step's fill: the last fill's rows, each one output further (_follows). The step before's
        fill is settled first (as the full path does before it reads that step's tokens), so at most one fill is
        ever unsettled: a failed one fails this launch and leaves no later stream wait behind."""
        _, rids, index = self._last
        self._last = None   # until the hand-over below is made
        prev.settle()
        sent = self.sent
        for rid in rids:
            sent[rid] += 1
        self._turn ^= 1
        fenced = self._fenced(self._turn, len(rids), None, index, beside)
        self._last = (sampled, rids, index)
        return fenced

    def _fenced(self, turn: int, n: int, work: list[tuple] | None, index: list[int] | None,
                beside: bool) -> FencedMask:
        """Hand the fill of n rows over with a new sequence number (work None: a steady fill, MaskWorker.ring),
        then queue the waits for it and the copy, and return the mask the sampler reads once the copy is in
        (see _queue_waits)."""
        matchers = self.matchers
        bitmask = self._host_buffer(turn, n)
        self._seq += 1
        if work is None:
            matchers.ring(turn, self._seq)
        else:
            matchers.fill(turn, work, bitmask.numpy(), self._seq)
        self._unsettled[turn] = self._seq
        fence = MaskFence(self, turn, self._seq, ring=work is None)
        try:
            mask = self._queue_waits(turn, fence.seq, bitmask, index, beside)
        except BaseException:
            self.settle(fence)   # the filler's answer is taken, so the next fill's is the next one read
            raise
        return FencedMask(mask, fence)

    def _queue_waits(self, turn: int, seq: int, bitmask, index, beside: bool) -> GrammarMask:
        """The waits for every filler's flag (each writes its own rows), then the bitmask's copy, on a stream of
        their own: the copy (1.2 MB at 64 rows, ~25 us) then runs as soon as the fill is in, during the forward
        pass, not between it and the sampler. The current stream waits for the copy only before the sampler.
        beside false (the forward is the cooperative persistent kernel, which needs every SM: a spinning wait
        beside it could hold the slot of one of its blocks): the waits queue behind the work queued so far."""
        if self._status is None:
            self._status = torch.zeros(2, len(self._flags), dtype=torch.int32, device=self.device)
        if self.device.type != "cuda":   # the CPU tests' emulated stream: the waits, then the copy, in order
            self._wait_flags(turn, seq)
            return self._device_mask(bitmask, turn, index)
        main = torch.cuda.current_stream(self.device)
        if self._copies is None:
            words = self._host[0].shape[1]
            self._dev = torch.empty(2, self.max_rows, words, dtype=torch.int32, device=self.device)
            self._dev_index = torch.empty(2, self.max_rows, dtype=torch.int64, device=self.device)
            self._copies = torch.cuda.Stream(self.device)
            beside = False   # the buffers above are made on the current stream
        side = self._copies
        with torch.cuda.stream(side):
            if not beside:
                side.wait_stream(main)
            elif self._free[turn] is not None:
                side.wait_event(self._free[turn])   # the sampler that last read these device buffers is done
            self._wait_flags(turn, seq)
            dev = self._dev_view(turn, bitmask.shape[0])
            dev.copy_(bitmask, non_blocking=True)
            rows = None if index is None else self._dev_rows(turn, index)
        main.wait_stream(side)
        self._free[turn ^ 1] = main.record_event()   # behind the sampler that reads the other turn's buffers
        return GrammarMask(dev, rows)

    # The views below are kept: a step at 64 rows made ~0.1 ms of torch calls on the engine thread here.
    def _dev_view(self, turn: int, n: int) -> torch.Tensor:
        view = self._views.get((turn, n))
        if view is None:
            view = self._views[(turn, n)] = self._dev[turn, :n]
        return view

    def _dev_rows(self, turn: int, index: list[int]) -> torch.Tensor:
        """The constrained rows' indices on the device (turn's buffer), copied unless this very list was the
        last copied there (a steady step reuses the last fill's)."""
        last = self._rows_sent[turn]
        if last is not None and last[0] is index:
            return last[1]
        rows = self._index[turn][:len(index)]
        rows.copy_(torch.as_tensor(index, dtype=torch.int64))
        dev = self._dev_index[turn, :len(index)].copy_(rows, non_blocking=True)
        self._rows_sent[turn] = (index, dev)
        return dev

    def _wait_flags(self, turn: int, seq: int) -> None:
        if self._waits is None:   # per turn, each filler's (status view, flag address)
            self._waits = [[(self._status[t, k:k + 1], self._flags[k, t:].ctypes.data) for k in range(len(self._flags))]
                           for t in range(2)]
        timeout_s = self._wait_timeout_s()
        for status, addr in self._waits[turn]:
            wait_for_host_flag(status, addr, seq, timeout_s)

    def _wait_timeout_s(self) -> float:
        # Longer than the worker's own answer may take (MaskWorker.timeout_s), so the host's error comes first.
        return 2 * self.cfg.compile_timeout_s + 30.0

    def settle(self, fence: MaskFence) -> None:
        """Take the filler's answer for a fenced step (once); on any failure let its stream go on, then raise."""
        if self._unsettled.get(fence.turn) != fence.seq:
            return
        del self._unsettled[fence.turn]
        try:
            if fence.ring:
                self._worker.settle_ring(fence.turn, fence.seq)
            else:
                self._worker.wait(fence.turn, self._host_buffer(fence.turn, 1).numpy())
        except BaseException:
            self._release(fence.turn, fence.seq)
            raise

    def publish(self, fence: MaskFence, token_ids) -> None:
        """Behind a fenced step's sampler, its tokens (by sampled row) into the worker's memory, where the next
        step's steady fill reads them (mask_worker._follow): queued on CUDA, stored at once on the CPU."""
        if self._last is None:   # the next step cannot follow on from this one
            return
        shared = self._worker.shared
        slot = fence.seq % 2
        if self.device.type == "cuda":
            publish_host_tokens(token_ids, shared.tokens[slot].ctypes.data, shared.token_flags[slot:].ctypes.data,
                                fence.seq)
        else:
            from minillm.structured.matchers import publish_flag
            shared.tokens[slot, :len(token_ids)] = token_ids.numpy()
            publish_flag(shared.token_flags, slot, fence.seq)
        self._published = fence.seq

    def _release(self, turn: int, seq: int) -> None:
        """A stream waiting for fill `seq` goes on (the step fails on the host)."""
        from minillm.structured.matchers import publish_flag
        for flags in self._flags:
            publish_flag(flags, turn, -seq)

    def finish(self, pending: PendingMask) -> GrammarMask:
        """The step's bitmask, once it is filled in a host buffer of ours, on its way to the device."""
        bitmask = self._host_buffer(pending.turn, pending.n)
        self._worker.wait(pending.turn, bitmask.numpy())
        return self._device_mask(bitmask, pending.turn, pending.index)

    def close(self) -> None:
        for turn, seq in list(self._unsettled.items()):
            self._release(turn, seq)
        self._unsettled.clear()
        if self._registered is not None:   # the worker's close unregisters it (before_unmap)
            self._registered = None
            self._host, self._flags = [], None   # views of the worker's memory, unmapped below
        self._waits = None
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def _work(self, sampled, rows, seq_lens, prev) -> list[tuple]:
        """Each constrained row's RowWork, as a plain tuple in its field order (matchers.RowWork says why)."""
        pending = None
        work = []
        sent = self.sent
        for j, i in enumerate(rows):
            r = sampled[i]
            rid, ids, prompt = r.request_id, r.all_token_ids, r.num_prompt_tokens
            before = int(seq_lens[i]) - prompt
            start = sent[rid]
            if start + 1 == before:   # the common case, one new token: no generator
                k = prompt + start
                if k < len(ids):
                    tokens = (ids[k],)
                else:
                    if pending is None:
                        pending = _pending_tokens(prev)
                    tokens = (pending[rid],)
            else:
                start = min(start, before)
                if prompt + before > len(ids) and pending is None:
                    pending = _pending_tokens(prev)
                tokens = tuple(_output_token(r, k, pending) for k in range(start, before))
            sent[rid] = before
            work.append((j, rid, start, tokens, before, before < r.sampling_params.min_tokens, i))
        return work

    def _device_mask(self, bitmask: torch.Tensor, turn: int, index: list[int] | None) -> GrammarMask:
        if index is None:
            return GrammarMask(self._to_device(bitmask), None)
        rows = self._index[turn][:len(index)]
        rows.copy_(torch.as_tensor(index, dtype=torch.int64))
        return GrammarMask(self._to_device(bitmask), self._to_device(rows))

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        # Pinned buffers used in turn: step N's copy is done before N + 2 refills its buffer (the engine has
        # resolved step N by then, and its event follows the copy).
        return host.to(self.device, non_blocking=True) if self.device.type != "cpu" else host.clone()

    def _host_buffer(self, turn: int, n: int) -> torch.Tensor:
        if not self._host:
            words = (self.vocab_size + 31) // 32
            pin = self.device.type == "cuda"
            self._host = [torch.empty(self.max_rows, words, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
            self._index = [torch.empty(self.max_rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        return self._host[turn][:n]


def _unregister(addr: int, device: torch.device) -> None:
    """Undo register_host_memory once nothing on the GPU may still read the memory."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    unregister_host_memory(addr)


def _output_token(r, k: int, pending: dict | None) -> int:
    """Output token k of request state r, from the host copy or, for the step still in flight, `pending`."""
    i = r.num_prompt_tokens + k
    ids = r.all_token_ids
    return ids[i] if i < len(ids) else pending[r.request_id]


def _pending_tokens(prev) -> dict[str, int]:
    """The tokens of the launched step `prev`, by request id, once its copy to the host is done."""
    if prev is None or prev.host_ids is None:
        raise RuntimeError("a constrained row is missing its previous token, and no step is in flight")
    prev.settle()   # its stream may wait for a fill: take the filler's answer first (FencedMask)
    if prev.done is not None:
        prev.done.synchronize()
    return dict(zip(prev.req_ids, prev.host_ids.tolist()))

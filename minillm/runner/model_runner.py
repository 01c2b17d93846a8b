"""ModelRunner: owns the model, the paged KV cache, the sampler and its own copy of every request's state;
executes one plain SchedulerOutput (minillm/contract.py) and hands back a ModelRunnerOutput (the sampled token of
each row that asked for one). It never sees a scheduler object, so the same messages could drive it in another
process.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from itertools import compress

import torch

from minillm.attention import make_attention_backend
from minillm.cache.spec import KVCacheSpec
from minillm.config import ConfigError, EngineConfig
from minillm.device import resolve_device, resolve_dtype
from minillm.contract import ModelRunnerOutput, SchedulerOutput
from minillm.model.loader import load_model, read_kv_scales, resolve_arch
from minillm.ops.launch import pdl_launches
from minillm.runner.cuda_graphs import DecodeGraphs, MegakernelGraphs, guarded_capture
from minillm.runner.input_batch import InputBuilder, PrevTokens, cdiv
from minillm.runner.kv_sizing import choose_num_blocks
from minillm.runner.plan import DeviceInfo, resolve_plan
from minillm.runner.request_state import CachedRequest, RequestStates
from minillm.runner.warmup import warm_up_shapes
from minillm.sampling.batch import SamplingBatchCache
from minillm.sampling.sampler import Sampler
from minillm.structured.rows import FencedMask, GrammarRows, PendingMask

log = logging.getLogger(__name__)

@dataclass
class InFlight:
    """A launched step: its sampled tokens are on the device until resolve() waits for them."""
    req_ids: list[str]
    token_ids: torch.Tensor | None          # on the device: feeds the next step's placeholder inputs
    logprobs: list | None
    host_ids: torch.Tensor | None           # pinned host copy being filled (CPU: the tokens themselves)
    done: object | None                     # torch.cuda.Event recorded after that copy (None on the CPU)
    sampled: list[CachedRequest] | None = None   # the request state each token belongs to
    pending: Callable[[], None] | None = None     # launches the sampler, once the step's grammar mask is filled
    fence: object | None = None     # its stream waits for the step's grammar mask (structured.rows.MaskFence)
    started: object | None = None   # a timing event at the step's first launch, when a profile asks (resolve())
    marks: list | None = None       # timing events of its phases, when ModelRunner.step_events collects them

    def complete(self) -> None:
        """Launch the sampler if it waits for a grammar mask (structured.mask_worker); the tokens follow."""
        if self.pending is not None:
            run, self.pending = self.pending, None
            run()

    def settle(self) -> None:
        """Before the host waits for this step's tokens: if its stream waits for a grammar mask, take the
        filler's answer (a failed fill raises here, after letting the stream go on)."""
        if self.fence is not None:
            fence, self.fence = self.fence, None
            fence.settle()

    def prev_tokens(self) -> PrevTokens | None:
        self.complete()
        if self.token_ids is None:
            return None
        return PrevTokens(self.token_ids, self.req_ids)


def _timing_event():
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _kv_spec(cfg: EngineConfig, arch, dtype, checkpoint_scales) -> tuple[KVCacheSpec, bool]:
    """The KV-cache spec, with an fp8 cache's scales from the checkpoint (checkpoint_scales(), 1.0 where it has
    none), and whether the checkpoint had any."""
    from minillm.ops.kv_quant import FP8_DTYPES
    scales = checkpoint_scales() if cfg.cache.kv_cache_dtype in FP8_DTYPES else None
    return KVCacheSpec.for_model(arch, cfg.cache.block_size, cfg.cache.kv_cache_dtype, dtype, scales), scales is not None


class ModelRunner:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.device = resolve_device(cfg.runtime.device)
        threads = cfg.runtime.host_threads_for()
        if threads is not None and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        self.dtype = resolve_dtype(cfg.model.dtype, self.device)
        self.kv_spec, self.plan = self._make_plan()
        p = self.plan
        self.attn_backend = make_attention_backend(p.attention_backend, mode=p.attention_mode,
                                                   min_partitions=p.decode_min_partitions,
                                                   ctas_per_sm=p.decode_ctas_per_sm, fuse_kv_write=p.fused_kv_write.on,
                                                   prefill_kernel=p.prefill_kernel,
                                                   prefill_sdpa_min_tokens=p.prefill_sdpa_min_tokens,
                                                   prefill_prefix_min_tokens=p.prefill_prefix_min_tokens)
        self.model, self.arch, self.model_dir = self._load_model()
        self.kv_spec, checkpoint_scales = _kv_spec(cfg, self.arch, self.dtype, self._checkpoint_kv_scales)
        self.attn_backend.bind_kv_cache(self.kv_spec)
        self.max_model_len = self._max_model_len()
        sched = cfg.scheduler
        # No step holds more tokens than the budget, prefill-first included (the scheduler's contract: a longer
        # prompt runs alone in budget-sized chunks). Buffers, the KV-sizing run and the warm-up use this bound,
        # capped at what a step can hold at all: max_num_seqs sequences of at most max_model_len tokens each.
        self.max_num_tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * self.max_model_len)
        if self.kv_spec.quantized and cfg.cache.calculate_kv_scales and not checkpoint_scales:
            self._calibrate_kv_scales()
        self.sampler = Sampler(seed=cfg.runtime.seed, cuda=p.fused_ops.on)
        self.sampling = SamplingBatchCache(self.device, self.vocab_size)
        tp = cfg.parallel.tensor_parallel_size
        self.grammar = GrammarRows(self.model_dir, self.vocab_size, cfg.structured, self.device, sched.max_num_seqs,
                                   defer=cfg.structured.overlap_masks and tp == 1,
                                   worker=cfg.structured.matchers_in_worker(self.device.type, tp),
                                   gpu_wait=cfg.structured.gpu_waits_for_masks(self.device.type, tp, p.fused_ops.on))
        # Packed before the KV pool is sized, so the pool is sized around its copy of the weights.
        self.megakernel = self._pack_megakernel()
        self.num_blocks = self._choose_num_blocks()
        self.kv_caches = self.kv_spec.allocate(self.num_blocks, self.device)
        self.inputs = InputBuilder(sched.max_num_seqs, self.max_num_tokens, self.max_model_len,
                                   cfg.cache.block_size, self.device)
        self.states = RequestStates()
        self.graphs = self.mega_graphs = None
        with self._launches():   # graphs keep the launch mode they were captured with
            if self.plan.cuda_graphs.on:
                self._capture_all()
            if self.device.type == "cuda":
                warm_up_shapes(self)
        # Two pinned buffers for sampled ids, used in turn: the copy of step N's tokens may still be pending
        # while step N-1's are read (async scheduling).
        pin = self.device.type == "cuda"
        self._out_host = [torch.zeros(sched.max_num_seqs, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._out_turn = 0
        self._timed = False   # launch(): timing events for a profile (resolve() reads their span)
        # A list: each resolved step appends its timing events (launch, forward done, sampler start, tokens
        # copied), for a benchmark's GPU busy time without a profiler (scripts/structured_bench.py).
        self.step_events: list | None = None

    def _make_plan(self):
        """The KV-cache spec and the execution plan, made before anything is allocated, from the model's
        config.json alone; the plan's verdicts are logged, and what runs slower than asked is said once."""
        cfg = self.cfg
        arch = resolve_arch(cfg.model.model, cfg.model.load_format)
        spec = KVCacheSpec.for_model(arch, cfg.cache.block_size, cfg.cache.kv_cache_dtype, self.dtype)
        plan = resolve_plan(cfg, arch, spec, self.dtype, DeviceInfo.of(self.device))
        log.info("%s", plan.describe())
        for notice in plan.notices:
            log.warning("minillm: %s", notice)
        return spec, plan

    def _calibrate_kv_scales(self) -> None:
        """An fp8 cache's scales from a calibration prefill (minillm/runner/kv_calibration.py), bound in place of
        the checkpoint's defaults of 1.0."""
        from minillm.runner.kv_calibration import calibrate_kv_scales

        cfg = self.cfg
        scales = calibrate_kv_scales(self, self.kv_spec.dtype)
        self.kv_spec = KVCacheSpec.for_model(self.arch, cfg.cache.block_size, cfg.cache.kv_cache_dtype, self.dtype,
                                             scales)
        self.attn_backend.bind_kv_cache(self.kv_spec)

    # NOTE: _load_model, _checkpoint_kv_scales and _choose_num_blocks are the hooks a tensor-parallel rank overrides
    # (minillm/parallel/tp_runner.py: its shard of the weights and of the KV scales; the smallest pool of all ranks).
    def _load_model(self):
        cfg = self.cfg
        return load_model(cfg.model.model, cfg.model.load_format, self.dtype, self.device, self.attn_backend,
                          seed=cfg.runtime.seed, kernels=self.plan.model_kernels())

    def _checkpoint_kv_scales(self) -> torch.Tensor | None:
        return read_kv_scales(self.model_dir, self.arch)

    def _choose_num_blocks(self) -> int:
        return choose_num_blocks(self, self.cfg.cache)

    def _capture_all(self) -> None:
        """The decode graphs (and the megakernel's), which the plan allows only where the decode path is
        graph-safe. A capture that fails anyway leaves the engine serving eagerly, and says so loudly."""
        failed = guarded_capture(self._capture_graphs, "decode CUDA graphs")
        if failed is None and self.megakernel is not None:
            failed = guarded_capture(self._capture_megakernel, "persistent-kernel CUDA graphs")
        if failed is not None:
            log.error("minillm: %s; this engine serves decode steps eagerly (slower). Please report this: the "
                      "execution plan marked the path graph-safe.", failed)
            self.graphs = self.mega_graphs = self.megakernel = None
            self.plan = self.plan.without_graphs(failed)

    def _capture_graphs(self) -> None:
        graphs = DecodeGraphs(self.model, self.kv_caches, self.cfg.scheduler.max_num_seqs, self.inputs.max_blocks,
                              self.cfg.cache.block_size, self.max_model_len, self.arch.hidden_size, self.dtype,
                              self.device)
        graphs.capture()
        self.graphs = graphs

    def _pack_megakernel(self):
        """The persistent decode kernel, where the plan put small decode steps on it (it runs under CUDA graphs
        only, like the decode graphs it stands in for)."""
        if not self.plan.megakernel.on:
            return None
        from minillm.ops import megakernel as mkops

        return mkops.DecodeMegakernel(self.model, None, self.plan.megakernel_rows, self.cfg.cache.block_size,
                                      self.max_model_len, min_partition_chunks=self.plan.megakernel_min_chunks)

    def _capture_megakernel(self) -> None:
        self.megakernel.bind_caches(self.kv_caches)
        graphs = MegakernelGraphs(self.megakernel, self.inputs.max_blocks)
        graphs.capture()
        self.mega_graphs = graphs

    def _max_model_len(self) -> int:
        limit = self.arch.max_position_embeddings
        asked = self.cfg.model.max_model_len
        if asked is None:
            return limit
        if asked > limit:
            raise ConfigError(f"model.max_model_len={asked} is not allowed: the model supports at most {limit} "
                              "positions (max_position_embeddings)")
        return asked

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    def update_states(self, so: SchedulerOutput) -> None:
        """Apply the step's request-state changes (new, finished, preempted requests, new blocks)."""
        self.inputs.release(self.states.apply(so))
        self.grammar.update(so)

    def execute(self, so: SchedulerOutput, prof=None) -> ModelRunnerOutput:
        """One synchronous step: launch it and wait for its tokens."""
        return self.resolve(self.launch(so, None, prof), prof)

    def _launches(self, megakernel_step: bool = False):
        """The launch mode of this engine's kernels: programmatic dependent launch where the plan says,
        except around a megakernel step. There the only kernel it would reach is the sampler after the LM head,
        and in interleaved A/B runs such steps took 1-3% longer with it (B = 1-8, H200, 7d4936f), while graph-path
        steps took 1-2% less (B = 32-256)."""
        return pdl_launches(self.plan.pdl.on and not megakernel_step)

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput, prev: InFlight | None, prof=None) -> InFlight:
        """Queue the step's GPU work (inputs, forward, sampling) and return without waiting for it.

        `prev`: the step still in flight, whose sampled tokens feed this step's placeholder inputs.
        """
        self._timed = prof is not None and self.device.type == "cuda"
        started = self._step_done() if self._timed else None
        self.update_states(so)
        reqs = self.states.rows(so.req_ids)
        step = self.inputs.build(so, reqs, prev.prev_tokens() if prev is not None else None)
        # Recorded after build(), which queues the previous step's sampler if it was deferred: the forward's start.
        marks = [_timing_event()] if self.step_events is not None and self.device.type == "cuda" else None
        meta = step.meta
        if prof is not None:
            prof.mark("build")
        path = self.plan.step_path(meta.num_decodes == meta.num_seqs, meta.seq_lens_cpu)
        if prof is not None:
            prof.count_path(path)
        with self._launches(path == "megakernel"):
            if path == "megakernel":
                hidden = self.mega_graphs.replay(step.input_ids, step.positions, meta)
            elif path == "graph":
                hidden = self.graphs.replay(step.input_ids, step.positions, meta)
            else:
                hidden = self.model(step.input_ids, step.positions, self.kv_caches, meta)
            inflight = self._sample(so, reqs, step, hidden, prof, prev, marks, beside=path != "megakernel")
        inflight.started = started
        return inflight

    def _sample(self, so: SchedulerOutput, reqs, step, hidden, prof, prev: InFlight | None,
                marks: list | None = None, beside: bool = True) -> InFlight:
        """The LM head and the sampler over the step's sampled rows, and the copy of their tokens to the host."""
        sampled = reqs if all(so.sample) else list(compress(reqs, so.sample))
        if not sampled:
            # Nothing to sample (a prompt chunk in mid-prompt), but resolve() must still wait for this step: the
            # staging buffers its inputs are being copied from are rebuilt two steps later.
            return InFlight([], None, None, None, self._step_done())
        logits = self.model.compute_logits(hidden[step.logits_indices], keep_dtype=True)
        if marks is not None:
            marks.append(_timing_event())
        if prof is not None:
            prof.mark("forward")
        seq_lens = step.meta.seq_lens_cpu
        if len(sampled) != len(reqs):
            seq_lens = list(compress(seq_lens, so.sample))
        # Constrained rows: their bitmask, built once the previous step's tokens are known (the forward pass of
        # this step is already queued); None when no row is constrained. It is filled beside this thread: either
        # the stream waits for it (FencedMask: the sampler is queued now, the host settles the fence before it
        # waits for the tokens) or the sampler waits for complete(), the next launch or this step's resolve
        # (minillm/structured/rows.py).
        mask = self.grammar.masks(sampled, seq_lens, prev, beside)
        batch = self.sampling.get(sampled, seq_lens)
        inflight = InFlight(so.sampled_req_ids(), None, None, None, None, sampled=sampled, marks=marks)
        if isinstance(mask, PendingMask):
            inflight.pending = lambda: self._run_deferred(inflight, logits, batch, mask)
            return inflight
        fence = None
        if isinstance(mask, FencedMask):
            inflight.fence, fence, mask = mask.fence, mask.fence, mask.mask
            if batch.logprobs is not None:
                inflight.settle()   # the sampler reads logprobs back at once: the host sees a failure first
        self._run_sampler(inflight, logits, batch, mask)
        if fence is not None:   # the next step's fill may follow on from these tokens
            self.grammar.publish(fence, inflight.token_ids)
        return inflight

    def _run_deferred(self, inflight: InFlight, logits, batch, mask) -> None:
        with self._launches():   # the launch mode launch() gives the sampler
            self._run_sampler(inflight, logits, batch, mask)

    # A deferred sampler runs from complete(), maybe outside launch()'s inference mode: the mask's buffers and the
    # sampler's tensors are inference tensors either way.
    @torch.inference_mode()
    def _run_sampler(self, inflight: InFlight, logits, batch, mask) -> None:
        if isinstance(mask, PendingMask):
            mask = mask.result()
        if inflight.marks is not None:
            inflight.marks.append(_timing_event())
        result = self.sampler(logits, batch, mask)
        inflight.token_ids, inflight.logprobs = result.token_ids, result.logprobs
        inflight.host_ids, inflight.done = self._copy_to_host(result.token_ids)
        if inflight.marks is not None:
            inflight.marks.append(_timing_event())

    def _copy_to_host(self, token_ids: torch.Tensor):
        """Start the device-to-host copy of the sampled ids right behind the sampler, so that waiting for
        them later does not also wait for a step launched after this one."""
        if self.device.type != "cuda":
            return token_ids, None
        self._out_turn ^= 1
        host = self._out_host[self._out_turn][: token_ids.numel()]
        host.copy_(token_ids, non_blocking=True)
        return host, self._step_done()

    def _step_done(self):
        """An event recorded behind the work queued so far (None on the CPU, where nothing is queued)."""
        if self.device.type != "cuda":
            return None
        done = torch.cuda.Event(enable_timing=self._timed)
        done.record()
        return done

    def resolve(self, inflight: InFlight, prof=None) -> ModelRunnerOutput:
        """Wait for a launched step's sampled tokens."""
        inflight.complete()
        inflight.settle()
        if inflight.done is not None:
            inflight.done.synchronize()
            if prof is not None and inflight.started is not None:
                prof.add_gpu(inflight.started.elapsed_time(inflight.done))
        tokens = inflight.host_ids.tolist() if inflight.host_ids is not None else []
        if inflight.marks is not None and len(inflight.marks) == 4 and self.step_events is not None:
            self.step_events.append(tuple(inflight.marks))
        if inflight.sampled is not None:
            self.states.append_sampled(inflight.sampled, tokens)
        if prof is not None:
            prof.mark("sample_sync")
        return ModelRunnerOutput(req_ids=inflight.req_ids, sampled_token_ids=tokens, logprobs=inflight.logprobs)

    def close(self) -> None:
        """Stop what this runner started beside it (the grammar mask worker, if any)."""
        self.grammar.close()

    def kv_bytes_per_block(self) -> int:
        return self.kv_spec.bytes_per_block

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.cfg.cache.block_size)

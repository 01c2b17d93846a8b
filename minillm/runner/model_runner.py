"""ModelRunner: owns the model, the paged KV cache, the sampler and its own copy of every request's state;
executes one plain SchedulerOutput (minillm/contract.py) and hands back a ModelRunnerOutput (the sampled token of
each row that asked for one). It never sees a scheduler object, so the same messages could drive it in another
process.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from itertools import compress

import torch

from minillm.attention import make_attention_backend
from minillm.cache.spec import KVCacheSpec
from minillm.config import ConfigError, EngineConfig
from minillm.device import resolve_device, resolve_dtype
from minillm.contract import ModelRunnerOutput, SchedulerOutput
from minillm.model.loader import load_model
from minillm.ops.choice import resolve_kernels
from minillm.ops.launch import pdl_launches
from minillm.runner.input_batch import InputBuilder, PrevTokens, cdiv
from minillm.runner.kv_sizing import choose_num_blocks
from minillm.runner.request_state import CachedRequest, RequestStates
from minillm.runner.warmup import warm_up_shapes
from minillm.sampling.batch import SamplingBatchCache
from minillm.sampling.sampler import Sampler

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

    def prev_tokens(self) -> PrevTokens | None:
        if self.token_ids is None:
            return None
        return PrevTokens(self.token_ids, self.req_ids)


class ModelRunner:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.device = resolve_device(cfg.runtime.device)
        self.dtype = resolve_dtype(cfg.model.dtype, self.device)
        self.kernels = resolve_kernels(cfg, self.device)
        self.attn_backend = make_attention_backend(self.kernels)
        self.model, self.arch, self.model_dir = self._load_model()
        self.kv_spec = KVCacheSpec.for_model(self.arch, cfg.cache.block_size, cfg.cache.kv_cache_dtype, self.dtype)
        self.attn_backend.bind_kv_cache(self.kv_spec)
        self.max_model_len = self._max_model_len()
        sched = cfg.scheduler
        # No step holds more tokens than the budget, prefill-first included (the scheduler's contract: a longer
        # prompt runs alone in budget-sized chunks). Buffers, the KV-sizing run and the warm-up use this bound,
        # capped at what a step can hold at all: max_num_seqs sequences of at most max_model_len tokens each.
        self.max_num_tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * self.max_model_len)
        self.sampler = Sampler(seed=cfg.runtime.seed, cuda=self.kernels.cuda)
        self.sampling = SamplingBatchCache(self.device, self.vocab_size)
        # Packed before the KV pool is sized, so the pool is sized around its copy of the weights.
        self.megakernel = self._pack_megakernel()
        self.num_blocks = self._choose_num_blocks()
        self.kv_caches = self.kv_spec.allocate(self.num_blocks, self.device)
        self.inputs = InputBuilder(sched.max_num_seqs, self.max_num_tokens, self.max_model_len,
                                   cfg.cache.block_size, self.device)
        self.states = RequestStates()
        with self._launches():   # graphs keep the launch mode they were captured with
            self.graphs = self._capture_graphs()
            self.mega_graphs = self._capture_megakernel()
            if self.device.type == "cuda":
                warm_up_shapes(self)
        # Two pinned buffers for sampled ids, used in turn: the copy of step N's tokens may still be pending
        # while step N-1's are read (async scheduling).
        pin = self.device.type == "cuda"
        self._out_host = [torch.zeros(sched.max_num_seqs, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._out_turn = 0

    # NOTE: _load_model and _choose_num_blocks are the hooks a tensor-parallel rank overrides
    # (minillm/parallel/tp_runner.py: its shard of the weights; the smallest pool of all ranks).
    def _load_model(self):
        cfg = self.cfg
        return load_model(cfg.model.model, cfg.model.load_format, self.dtype, self.device, self.attn_backend,
                          seed=cfg.runtime.seed, kernels=self.kernels)

    def _choose_num_blocks(self) -> int:
        return choose_num_blocks(self, self.cfg.cache)

    def _capture_graphs(self):
        """Decode graphs only where they are safe: a GPU, our CUDA attention (host-sync free), not eager."""
        if self.device.type != "cuda" or self.cfg.runtime.enforce_eager:
            return None
        if self.kernels.attention != "cuda":
            log.info("CUDA graphs need the CUDA attention backend; running decode eagerly")
            return None
        from minillm.runner.cuda_graphs import DecodeGraphs
        graphs = DecodeGraphs(self.model, self.kv_caches, self.cfg.scheduler.max_num_seqs, self.inputs.max_blocks,
                              self.cfg.cache.block_size, self.max_model_len, self.arch.hidden_size, self.dtype,
                              self.device)
        graphs.capture()
        return graphs

    def _pack_megakernel(self):
        """The persistent decode kernel for small decode steps, where the KernelChoice allows it and it covers this
        model and GPU (it runs under CUDA graphs only, like the decode graphs it stands in for)."""
        rows = min(self.kernels.megakernel_max_batch, self.cfg.scheduler.max_num_seqs)
        if rows == 0 or self.device.type != "cuda" or self.cfg.runtime.enforce_eager:
            return None
        from minillm.ops import megakernel as mkops

        reason = mkops.unsupported_reason(self.arch, self.dtype, self.cfg.cache.block_size, rows,
                                          **mkops.device_limits(self.device))
        if reason is not None:
            log.info("decode megakernel not used: %s", reason)
            self.kernels = dataclasses.replace(self.kernels, megakernel_max_batch=0)   # results lines say so
            return None
        return mkops.DecodeMegakernel(self.model, None, rows, self.cfg.cache.block_size, self.max_model_len,
                                      min_partition_chunks=self.kernels.megakernel_min_chunks)

    def _capture_megakernel(self):
        if self.megakernel is None:
            return None
        from minillm.ops.megakernel import MegakernelGraphs

        self.megakernel.bind_caches(self.kv_caches)
        graphs = MegakernelGraphs(self.megakernel, self.inputs.max_blocks)
        graphs.capture()
        return graphs

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

    def execute(self, so: SchedulerOutput, prof=None) -> ModelRunnerOutput:
        """One synchronous step: launch it and wait for its tokens."""
        return self.resolve(self.launch(so, None, prof), prof)

    def _launches(self, megakernel_step: bool = False):
        """The launch mode of this engine's kernels: programmatic dependent launch where the KernelChoice says,
        except around a megakernel step. There the only kernel it would reach is the sampler after the LM head,
        and in interleaved A/B runs such steps took 1-3% longer with it (B = 1-8, H200, 7d4936f), while graph-path
        steps took 1-2% less (B = 32-256)."""
        return pdl_launches(self.kernels.pdl and not megakernel_step)

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput, prev: InFlight | None, prof=None) -> InFlight:
        """Queue the step's GPU work (inputs, forward, sampling) and return without waiting for it.

        `prev`: the step still in flight, whose sampled tokens feed this step's placeholder inputs.
        """
        self.update_states(so)
        reqs = self.states.rows(so.req_ids)
        step = self.inputs.build(so, reqs, prev.prev_tokens() if prev is not None else None)
        meta = step.meta
        if prof is not None:
            prof.mark("build")
        decode_only = meta.num_decodes == meta.num_seqs
        mega = decode_only and self.mega_graphs is not None and self.mega_graphs.bucket(meta.num_seqs) \
            and sum(meta.seq_lens_cpu) <= self.kernels.megakernel_max_tokens
        with self._launches(mega):
            if mega:
                hidden = self.mega_graphs.replay(step.input_ids, step.positions, meta)
            elif decode_only and self.graphs is not None and self.graphs.bucket(meta.num_seqs):
                hidden = self.graphs.replay(step.input_ids, step.positions, meta)
            else:
                hidden = self.model(step.input_ids, step.positions, self.kv_caches, meta)
            return self._sample(so, reqs, step, hidden, prof)

    def _sample(self, so: SchedulerOutput, reqs, step, hidden, prof) -> InFlight:
        """The LM head and the sampler over the step's sampled rows, and the copy of their tokens to the host."""
        sampled = reqs if all(so.sample) else list(compress(reqs, so.sample))
        if not sampled:
            # Nothing to sample (a prompt chunk in mid-prompt), but resolve() must still wait for this step: the
            # staging buffers its inputs are being copied from are rebuilt two steps later.
            return InFlight([], None, None, None, self._step_done())
        logits = self.model.compute_logits(hidden[step.logits_indices], keep_dtype=True)
        if prof is not None:
            prof.mark("forward")
        seq_lens = step.meta.seq_lens_cpu
        if len(sampled) != len(reqs):
            seq_lens = list(compress(seq_lens, so.sample))
        result = self.sampler(logits, self.sampling.get(sampled, seq_lens))
        return InFlight(so.sampled_req_ids(), result.token_ids, result.logprobs,
                        *self._copy_to_host(result.token_ids), sampled=sampled)

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
        done = torch.cuda.Event()
        done.record()
        return done

    def resolve(self, inflight: InFlight, prof=None) -> ModelRunnerOutput:
        """Wait for a launched step's sampled tokens."""
        if inflight.done is not None:
            inflight.done.synchronize()
        tokens = inflight.host_ids.tolist() if inflight.host_ids is not None else []
        if inflight.sampled is not None:
            self.states.append_sampled(inflight.sampled, tokens)
        if prof is not None:
            prof.mark("sample_sync")
        return ModelRunnerOutput(req_ids=inflight.req_ids, sampled_token_ids=tokens, logprobs=inflight.logprobs)

    def kv_bytes_per_block(self) -> int:
        return self.kv_spec.bytes_per_block

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.cfg.cache.block_size)

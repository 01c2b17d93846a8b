"""ModelRunner: owns the model, the paged KV cache and the sampler; executes one SchedulerOutput.

It reads requests and never mutates scheduler state: the only thing that flows back is a
ModelRunnerOutput (the sampled token of each sequence that asked for one).
"""
from __future__ import annotations

import logging

import torch

from minillm.attention import make_attention_backend
from minillm.config import ConfigError, EngineConfig
from minillm.engine.outputs import ModelRunnerOutput, SchedulerOutput
from minillm.model.loader import load_model
from minillm.runner.input_batch import InputBuilder, cdiv
from minillm.runner.kv_sizing import allocate_kv_cache, choose_num_blocks
from minillm.sampling.batch import SamplingBatch
from minillm.sampling.sampler import Sampler

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"runtime.device={name!r} is not available: no CUDA GPU found; use cpu or auto")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' = bfloat16 on a GPU, float32 on the CPU (CPU bf16 matmuls are slow and only emulated)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class ModelRunner:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.device = resolve_device(cfg.runtime.device)
        self.dtype = resolve_dtype(cfg.model.dtype, self.device)
        torch.manual_seed(cfg.runtime.seed)
        self.attn_backend = make_attention_backend(cfg.runtime.attention, cfg.runtime.attention_mode, self.device)
        self.model, self.arch, self.model_dir = load_model(cfg.model.model, cfg.model.load_format, self.dtype,
                                                           self.device, self.attn_backend, seed=cfg.runtime.seed)
        self.max_model_len = self._max_model_len()
        sched = cfg.scheduler
        # A step never holds more tokens than the budget, but a prefill-first step holds one whole prompt.
        self.max_num_tokens = max(sched.max_num_batched_tokens, self.max_model_len)
        self.sampler = Sampler(seed=cfg.runtime.seed)
        self.num_blocks = choose_num_blocks(self, cfg.cache)
        self.kv_caches = allocate_kv_cache(self.arch, self.num_blocks, cfg.cache.block_size, self.dtype, self.device)
        self.inputs = InputBuilder(sched.max_num_seqs, self.max_num_tokens, self.max_model_len,
                                   cfg.cache.block_size, self.device)
        self.graphs = self._capture_graphs()

    def _capture_graphs(self):
        """Decode graphs only where they are safe: a GPU, our CUDA attention (host-sync free), not eager."""
        if self.device.type != "cuda" or self.cfg.runtime.enforce_eager:
            return None
        if type(self.attn_backend).__name__ != "CudaAttentionBackend":
            log.info("CUDA graphs need the CUDA attention backend; running decode eagerly")
            return None
        from minillm.runner.cuda_graphs import DecodeGraphs
        graphs = DecodeGraphs(self.model, self.kv_caches, self.cfg.scheduler.max_num_seqs, self.inputs.max_blocks,
                              self.cfg.cache.block_size, self.max_model_len, self.arch.hidden_size, self.dtype,
                              self.device)
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

    def release(self, req_ids) -> None:
        """Forget finished/aborted requests' block-table rows."""
        self.inputs.release(req_ids)

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput, prof=None) -> ModelRunnerOutput:
        step = self.inputs.build(so)
        meta = step.meta
        if prof is not None:
            prof.mark("build")
        if self.graphs is not None and meta.num_decodes == meta.num_seqs and self.graphs.bucket(meta.num_seqs):
            hidden = self.graphs.replay(step.input_ids, step.positions, meta)
        else:
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, meta)
        if not step.sample_seq_idx:
            return ModelRunnerOutput()
        logits = self.model.compute_logits(hidden[step.logits_indices])
        if prof is not None:
            prof.mark("forward")
        reqs = [so.scheduled[i].request for i in step.sample_seq_idx]
        batch = SamplingBatch.build(reqs, self.device, self.vocab_size)
        result = self.sampler(logits, batch)
        out = ModelRunnerOutput(req_ids=[r.request_id for r in reqs],
                                sampled_token_ids=result.token_ids.tolist(), logprobs=result.logprobs)
        if prof is not None:
            prof.mark("sample_sync")
        return out

    @torch.inference_mode()
    def profile_peak_bytes(self) -> int:
        """Peak GPU memory of the largest step (a budget-sized prefill + max_num_seqs sampled rows), KV excluded."""
        from minillm.runner.kv_sizing import profile_run
        return profile_run(self)

    def kv_bytes_per_block(self) -> int:
        a = self.arch
        return 2 * a.num_hidden_layers * self.cfg.cache.block_size * a.num_key_value_heads * a.head_dim * \
            torch.tensor([], dtype=self.dtype).element_size()

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.cfg.cache.block_size)

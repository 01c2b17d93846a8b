"""LLM: the Python API. A thin facade over LLMEngine: offline generate() plus the streaming primitives."""
from __future__ import annotations

import gc
from typing import Sequence

from minillm.config import EngineConfig
from minillm.engine.engine import LLMEngine
from minillm.engine.outputs import RequestOutput, StepOutput
from minillm.engine.prompts import PreparedPrompt
from minillm.progress import TokenProgress
from minillm.sampling_params import SamplingParams


def freeze_heap() -> None:
    """Move every object built so far (model, tokenizer, imported libraries: ~200k objects for an engine) out of
    the cycle collector's reach, for a process whose job is serving (the CLI commands, the HTTP server, the
    benchmarks call it once the engine is built).

    A full collection walks every tracked object, ~90 ms here, and one that fires while serving lands in some
    token's inter-token latency (an ITL max of 104 ms at 8 req/s on the H200, f3b9a6d). It is process-wide, so
    the library never does it on its own: LLM() leaves the caller's heap alone. A process that drops an engine
    and builds another calls gc.unfreeze() first (minillm.bench.offline.free_device_memory), so the old one can
    be collected.
    """
    gc.collect()
    gc.freeze()


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs):
        self._init(EngineConfig.from_kwargs(model, **engine_kwargs))

    @classmethod
    def from_config(cls, cfg: EngineConfig, serving: bool = False) -> "LLM":
        """serving: for a serving front end (parallel.engine_process auto then puts the core in a process)."""
        llm = cls.__new__(cls)
        llm._init(cfg.validate(), serving)
        return llm

    def _init(self, cfg: EngineConfig, serving: bool = False) -> None:
        self.config = cfg
        self.engine = LLMEngine(cfg, serving)

    def close(self) -> None:
        """Stop the engine-core processes and tensor-parallel workers, if any; in-process engines need nothing.
        Also done when the LLM is collected and at interpreter exit."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- facts about the loaded engine ----
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_arch(self):
        return self.engine.runner.arch

    @property
    def dtype(self):
        return self.engine.runner.dtype

    @property
    def device(self):
        return self.engine.runner.device

    @property
    def num_preemptions(self) -> int:
        return self.engine.num_preemptions

    def stats(self):
        """EngineStats: running and waiting requests, KV-cache usage, preemptions (a cheap snapshot)."""
        return self.engine.stats()

    # ---- streaming primitives ----
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, enable_thinking: bool | None = None) -> str:
        """enable_thinking: passed to the chat template when the prompt is a list of chat messages (Qwen3). A
        prompt that prepare_prompt returned is not checked id by id again."""
        return self.engine.add_request(prompt, params, request_id, priority, enable_thinking=enable_thinking)

    def prepare_prompt(self, prompt, params: SamplingParams, enable_thinking: bool | None = None,
                       tools: list[dict] | None = None) -> PreparedPrompt:
        """The prompt's token ids (a tuple), checked as add_request checks them (ValueError naming the problem), without
        admitting anything. It reads no engine state that step() changes, so a front end may call it from its own
        thread and hand add_request the ids: tokenizing then costs the stepping thread nothing."""
        return self.engine.prompts.prepare(prompt, params, enable_thinking, tools)

    def compile_grammar(self, spec):
        """Start compiling a structured-output spec off the calling thread (see LLMEngine.compile_grammar)."""
        return self.engine.compile_grammar(spec)

    def step(self) -> list[StepOutput]:
        return self.engine.step()

    @property
    def engine_in_process(self) -> bool:
        """False when the engine core runs in processes of its own (parallel.engine_process)."""
        return self.engine.in_process

    def check_engine(self, timeout_s: float = 0.0) -> None:
        """Raise EngineDeadError (minillm.engine.core_client) if an engine-core process has died; with engine
        processes, first wait up to timeout_s for their news (stats) or a wake(). In-process: returns at once."""
        self.engine.check(timeout_s)

    def wake(self) -> None:
        """Make a step() that waits on engine-core processes return now, e.g. because a request arrived
        (safe from any thread; a no-op for an in-process engine)."""
        self.engine.wake()

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    # ---- offline ----
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priorities: Sequence[int] | None = None, use_tqdm: bool = True,
                 enable_thinking: bool | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order. All prompts are validated before any runs:
        a bad one raises ValueError naming its index and nothing is admitted."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = _per_prompt(sampling_params, len(prompts), "sampling_params")
        prios = _per_prompt(priorities, len(prompts), "priorities", default=0)
        prepared = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            try:
                prepared.append(self.engine.prompts.prepare(p, sp, enable_thinking))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        ids = [self.engine.add_request(p, sp, priority=pr, stream=False)
               for p, sp, pr in zip(prepared, params, prios)]
        results: dict[str, RequestOutput] = {}
        with TokenProgress(len(ids), use_tqdm, transient=True) as advance:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.output is not None:
                        results[out.request_id] = out.output
                        advance(len(out.output.token_ids))
        return [results[i] for i in ids]


def _per_prompt(value, n: int, name: str, default=None) -> list:
    if value is None:
        return [SamplingParams() if default is None else default] * n
    if isinstance(value, (SamplingParams, int)):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
    return value

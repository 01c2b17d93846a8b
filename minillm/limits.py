"""Resource arithmetic: refuse sizes and counts that cannot fit before anything is allocated.

Each check compares what a setting makes the engine allocate up front (weights, KV pool, per-step and
per-sequence buffers) with the memory the device has free, and raises ConfigError naming the setting, the bytes
it needs and the largest value that would fit. The estimates count only what is certainly allocated (not
attention scratch, which depends on the prompts), so they refuse only what cannot possibly work; they exist to
turn a 65 TB request into a message instead of a MemoryError or a visit from the OOM killer.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from minillm.config import ConfigError

# Use at most this fraction of the memory that is free: the estimates leave out allocator slack and the
# Python objects around the tensors.
USABLE_FRACTION = 0.9
# Host bytes per KV block outside the tensor: the block pool's free list entry, hash slots and table entries.
HOST_BYTES_PER_BLOCK = 160


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# ---------------------------------------------------------------- what is free

def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_free(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process's memory cgroup still allows (v2 or v1), or None without a limit. Inside a container
    the OOM killer acts on this limit, not on the host's free memory."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.lstrip("/")
        if controllers == "":          # v2
            candidates = [(root / rel, "memory.max", "memory.current")]
        elif "memory" in controllers.split(","):
            candidates = [(root / "memory" / rel, "memory.limit_in_bytes", "memory.usage_in_bytes"),
                          (root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes")]
        else:
            continue
        for base, limit_file, usage_file in candidates:
            limit, usage = _read_int(base / limit_file), _read_int(base / usage_file)
            if limit is not None and usage is not None and limit < (1 << 60):   # v1 "no limit" is ~2**63
                return max(limit - usage, 0)
    return None


def host_free_bytes() -> int | None:
    """Memory a new allocation can take on this machine: MemAvailable, bounded by the cgroup's limit."""
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if free is None and hasattr(os, "sysconf"):
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            free = None
    cgroup = cgroup_free()
    if cgroup is not None:
        free = cgroup if free is None else min(free, cgroup)
    return free


def device_free_bytes(device) -> int | None:
    """Free bytes on `device` (a torch.device): the GPU's free memory, or the host's for the CPU."""
    if device.type == "cuda":
        import torch
        return torch.cuda.mem_get_info(device)[0]
    return host_free_bytes()


def usable(free: int | None) -> int | None:
    return None if free is None else int(free * USABLE_FRACTION)


# ---------------------------------------------------------------- model weights

def check_weights_fit(arch, dtype_bytes: int, device, source: str) -> None:
    """Refuse a model whose parameters, with the RoPE table built for every position it supports (float32,
    about twice its size while it is built), do not fit in the device's free memory."""
    weights = arch.num_params * dtype_bytes
    rope = arch.max_position_embeddings * arch.head_dim * 4 * 2
    room = usable(device_free_bytes(device))
    if room is None or weights + rope <= room:
        return
    where = f"{device.type} memory has {fmt_bytes(room)} free to use"
    if rope > weights:
        raise ConfigError(f"{source}: max_position_embeddings={arch.max_position_embeddings:,} needs a RoPE table of "
                          f"{fmt_bytes(rope)}, and {where}")
    raise ConfigError(
        f"{source} has {arch.num_params:,} parameters: {fmt_bytes(weights)} at {dtype_bytes} bytes each, and "
        f"{where} (hidden_size={arch.hidden_size}, vocab_size={arch.vocab_size}, num_hidden_layers="
        f"{arch.num_hidden_layers}, intermediate_size={arch.intermediate_size}): at most "
        f"{max(room - rope, 0) // dtype_bytes:,} parameters would fit")


# ---------------------------------------------------------------- step buffers and the KV pool

@dataclass(frozen=True)
class EngineShape:
    """The settings that size the engine's buffers, with the model facts they multiply."""
    max_num_seqs: int
    max_num_tokens: int          # the step budget, already capped at what a step can use
    max_model_len: int
    block_size: int
    hidden_size: int
    intermediate_size: int
    q_size: int
    kv_size: int
    vocab_size: int
    dtype_bytes: int

    @property
    def per_seq_bytes(self) -> int:
        """Per running-sequence slot: its block-table row, staging entries and a block-table row in each of the
        two packed input sets (minillm/runner/input_batch.py), sampled-id buffers, and one row of the decode
        graph's hidden state."""
        max_blocks = -(-self.max_model_len // self.block_size)
        return 3 * max_blocks * 4 + 2 * (4 + 4 + 8) + 2 * 8 + self.hidden_size * self.dtype_bytes

    @property
    def per_token_bytes(self) -> int:
        """Per token of the step budget: staging (ids, positions, slots; two sets) and the largest activations a
        layer holds at once (its input and residual, q/k/v, gate and up projections, their product)."""
        act = 2 * self.hidden_size + self.q_size + 2 * self.kv_size + 3 * self.intermediate_size
        return 2 * 3 * 8 + 8 + act * self.dtype_bytes

    @property
    def logits_bytes(self) -> int:
        """float32 logits rows the sampler holds for the rows it samples (logits, probabilities, noise): one
        per sequence, and no more than the step has tokens."""
        return min(self.max_num_seqs, self.max_num_tokens) * self.vocab_size * 4 * 3

    @property
    def step_bytes(self) -> int:
        return self.max_num_seqs * self.per_seq_bytes + self.max_num_tokens * self.per_token_bytes + \
            self.logits_bytes


def check_step_fits(shape: EngineShape, free: int | None, where: str) -> None:
    """Refuse a max_num_seqs or step budget whose buffers cannot fit in `free` bytes; name the one that
    dominates and the largest value of it that would fit."""
    room = usable(free)
    if room is None or shape.step_bytes <= room:
        return
    seq_part = shape.max_num_seqs * shape.per_seq_bytes
    tok_part = shape.max_num_tokens * shape.per_token_bytes + shape.logits_bytes
    if seq_part >= tok_part:
        fit = max((room - tok_part) // shape.per_seq_bytes, 0)
        raise ConfigError(
            f"scheduler.max_num_seqs={shape.max_num_seqs:,} needs {fmt_bytes(seq_part)} of per-sequence buffers "
            f"(block tables for max_model_len {shape.max_model_len}), and {where} has {fmt_bytes(room)} free to "
            f"use: at most {fit:,} would fit")
    fit = _max_tokens(shape, room - seq_part)
    raise ConfigError(
        f"scheduler.max_num_batched_tokens: a step of {shape.max_num_tokens:,} tokens (the budget, capped at "
        f"max_num_seqs x max_model_len) needs {fmt_bytes(tok_part)} of step buffers and activations, and {where} has "
        f"{fmt_bytes(room)} free to use: at most {fit:,} tokens per step would fit")


def _max_tokens(shape: EngineShape, room: int) -> int:
    """The largest step budget whose buffers fit in `room`; logits rows grow with it up to max_num_seqs."""
    row = shape.vocab_size * 4 * 3
    if room <= 0:
        return 0
    full_rows = (room - shape.max_num_seqs * row) // shape.per_token_bytes
    if full_rows >= shape.max_num_seqs:
        return full_rows
    return room // (shape.per_token_bytes + row)


def check_kv_fits(num_blocks: int, bytes_per_block: int, free: int | None, where: str, setting: str) -> None:
    """Refuse a KV pool of `num_blocks` that does not fit in `free` bytes (what is left after the model and the
    step buffers); `setting` names what chose the size, for the message."""
    room = usable(free)
    if room is None or num_blocks * bytes_per_block <= room:
        return
    raise ConfigError(
        f"{setting} needs {fmt_bytes(num_blocks * bytes_per_block)} of KV cache "
        f"({num_blocks:,} blocks of {fmt_bytes(bytes_per_block)}), and {where} has {fmt_bytes(room)} free to use "
        f"after the model and step buffers: at most {room // bytes_per_block:,} blocks would fit")


# ---------------------------------------------------------------- one request

# Stop strings are matched against the new text of every step, each one (minillm/detokenizer.py): their count and
# length bound that per-step cost. 32 strings of 256 characters are far more than any client sends (OpenAI allows
# 4); 100,000 of them made every concurrent stream several times slower.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
# Rendering a chat template (minillm/chat_template.py) runs in a worker process that is killed past this time,
# with this address-space limit; its output is capped at what max_model_len tokens could hold.
CHAT_TEMPLATE_TIMEOUT_S = 5.0
CHAT_TEMPLATE_MEMORY_BYTES = 2 << 30


def check_request(params, vocab_size: int, max_num_seqs: int | None) -> None:
    """Counts and ids of one request that the engine could not honour: n beyond the sequences that can run at
    once (each completion is a sequence; n = 10**9 would otherwise build 10**9 of them), logprobs beyond the
    vocabulary, stop token ids outside it, more or longer stop strings than MAX_STOP_*. Raises ValueError (a
    per-request error)."""
    if len(params.stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop has {len(params.stop):,} strings; at most {MAX_STOP_STRINGS} are allowed")
    longest = max(params.stop, key=len, default="")
    if len(longest) > MAX_STOP_STRING_CHARS:
        raise ValueError(f"stop has a string of {len(longest):,} characters; at most {MAX_STOP_STRING_CHARS} are "
                         f"allowed")
    if max_num_seqs is not None and params.n > max_num_seqs:
        raise ValueError(f"n={params.n} is more completions than can run at once: at most "
                         f"scheduler.max_num_seqs={max_num_seqs}")
    if params.logprobs is not None and params.logprobs > vocab_size:
        raise ValueError(f"logprobs={params.logprobs} is more than the vocabulary's {vocab_size} tokens")
    outside = [t for t in params.stop_token_ids if t >= vocab_size]
    if outside:
        raise ValueError(f"stop_token_ids {outside[:5]} are outside the vocabulary [0, {vocab_size})")

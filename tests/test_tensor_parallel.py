"""Tensor parallelism over gloo on the CPU: greedy tokens of TP=2 and TP=4 equal HF transformers' (fp32) on tiny
random Qwen3 and Qwen2 checkpoints, across chunked prefill, prefix-cache hits and preemption; TP=4 on a model
with 2 KV heads replicates them; a rank's shard of each checkpoint tensor is the right slice; a worker that dies
fails the engine with an error naming it; an fp8 cache, with per-head checkpoint scales or calibrated ones, gives
the TP=1 tokens. The engine tests spawn ranks (seconds each): marked slow."""
import os
import random
import signal
import threading
import time

import pytest
import torch
from safetensors import safe_open

from minillm import LLM, SamplingParams
from minillm.config import ConfigError
from minillm.model.arch import ModelArchConfig
from minillm.parallel.tp_model import first_kv_head, local_arch, shard_kv_scales, shard_tensor
from tiny_models import hf_greedy, with_tensors

MAX_LEN = 96
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


# The tiny checkpoints of test_engine_hf (qwen2_dir: 4 query heads over 2 KV heads, q/k/v bias, an untied head).
from test_engine_hf import qwen2_dir, qwen3_dir  # noqa: E402,F401  (pytest fixtures)


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in (1, 5, 16, 17, 33, 40)]


@pytest.mark.parametrize("tp", [2, 4])
def test_shards_tile_every_split_tensor(qwen2_dir, tp):
    arch = ModelArchConfig.from_dir(qwen2_dir)
    with safe_open(qwen2_dir / "model.safetensors", framework="pt") as f:
        for name in f.keys():
            full = f.get_tensor(name)
            parts = [shard_tensor(arch, tp, r)(name, f.get_slice(name)) for r in range(tp)]
            if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
                hd = arch.head_dim
                for r, part in enumerate(parts):   # rank r holds its KV heads (replicated when tp > 2)
                    first = first_kv_head(arch, tp, r)
                    assert torch.equal(part, full[first * hd:first * hd + part.shape[0]])
                assert part.shape[0] == hd * max(1, arch.num_key_value_heads // tp)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                assert torch.equal(torch.cat(parts, 1), full)
            elif "norm" in name:
                assert all(torch.equal(p, full) for p in parts)
            else:
                assert torch.equal(torch.cat(parts, 0), full), name


@pytest.mark.parametrize("tp,heads_of_rank", [(2, [[0], [1]]), (4, [[0], [0], [1], [1]])])
def test_a_rank_takes_its_kv_heads_of_per_head_scales(qwen2_dir, tp, heads_of_rank):
    arch = ModelArchConfig.from_dir(qwen2_dir)   # 2 KV heads: split at tp 2, replicated at tp 4
    scales = torch.arange(arch.num_hidden_layers * 2 * 2, dtype=torch.float32).reshape(-1, 2, 2) + 1
    for rank, heads in enumerate(heads_of_rank):
        assert torch.equal(shard_kv_scales(scales, arch, tp, rank), scales[:, :, heads])


def test_a_size_the_group_cannot_split_is_a_config_error(qwen3_dir):
    arch = ModelArchConfig.from_dir(qwen3_dir)
    with pytest.raises(ConfigError, match="num_attention_heads=4 is not a multiple"):
        local_arch(arch, 3)
    assert local_arch(arch, 4).num_key_value_heads == 1


def _run_and_check(path, tp: int, hf_cache: dict) -> None:
    prompts = _prompts()
    # 14 blocks of 16 tokens cannot hold six sequences of up to 40 + 24 tokens: preemption; a 32-token budget
    # chunks the longer prompts; the second pass over the same prompts hits the prefix cache.
    with LLM(str(path), device="cpu", dtype="float32", max_model_len=MAX_LEN, tensor_parallel_size=tp,
             num_kv_blocks=14, max_num_batched_tokens=32, check_integrity=True) as llm:
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.num_preemptions > 0
        second = llm.generate(prompts[3:], GREEDY, use_tqdm=False)
        assert any(o.num_cached_tokens > 0 for o in second)
        for prompt, out in zip(prompts + prompts[3:], first + second):
            key = (str(path), tuple(prompt))
            if key not in hf_cache:
                hf_cache[key] = hf_greedy(path, prompt, GREEDY.max_tokens)
            assert out.token_ids == hf_cache[key]


@pytest.fixture(scope="module")
def hf_cache():
    return {}


@pytest.mark.slow
def test_tp2_qwen3_equals_hf_across_chunks_prefix_hits_and_preemption(qwen3_dir, hf_cache):
    _run_and_check(qwen3_dir, 2, hf_cache)


@pytest.mark.slow
def test_tp4_qwen2_replicates_kv_heads_and_equals_hf(qwen2_dir, hf_cache):
    _run_and_check(qwen2_dir, 4, hf_cache)


@pytest.mark.slow
def test_tp2_penalties_take_the_synchronous_path_and_equal_tp1(qwen2_dir):
    params = SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3, ignore_eos=True)
    prompts = _prompts(1)[:3]
    ref = LLM(str(qwen2_dir), device="cpu", max_model_len=MAX_LEN).generate(prompts, params, use_tqdm=False)
    with LLM(str(qwen2_dir), device="cpu", max_model_len=MAX_LEN, tensor_parallel_size=2) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]


@pytest.mark.slow
@pytest.mark.parametrize("scales", ["checkpoint", "calibrated"])
def test_tp2_fp8_cache_equals_tp1(qwen3_dir, tmp_path, scales):
    # checkpoint: each KV head its own scale, far from 1.0; a rank that read another head's scale, or that refused
    # the per-head shape against its one local head, would not give the TP=1 tokens. calibrated: no checkpoint
    # scales, so every rank runs the start-up calibration over its own heads (the ranks prefill together).
    d = qwen3_dir
    if scales == "checkpoint":
        arch = ModelArchConfig.from_dir(qwen3_dir)
        d = with_tensors(qwen3_dir, tmp_path / "scaled", {
            f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor([0.02, 0.05]) * (1 + i + 3 * (kv == "v"))
            for i in range(arch.num_hidden_layers) for kv in ("k", "v")})
    prompts, kw = _prompts(3)[:4], dict(device="cpu", dtype="float32", max_model_len=MAX_LEN, kv_cache_dtype="fp8")
    one = LLM(str(d), **kw)
    ref = one.generate(prompts, GREEDY, use_tqdm=False)
    assert (one.engine.runner.kv_spec.scales != 1.0).all()
    with LLM(str(d), tensor_parallel_size=2, **kw) as llm:
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]


@pytest.mark.slow
def test_a_dead_worker_fails_the_engine_with_an_error_naming_it(qwen3_dir):
    with LLM(str(qwen3_dir), device="cpu", max_model_len=MAX_LEN, tensor_parallel_size=2,
             distributed_timeout_s=5) as llm:
        worker = llm.engine.core.runner.workers.procs[0]
        threading.Timer(0.5, os.kill, (worker.pid, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1 exited"):
            llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=80, ignore_eos=True), use_tqdm=False)
        assert time.monotonic() - start < 30


@pytest.mark.slow
def test_tp2_ranks_under_two_engine_processes_equal_tp1(qwen3_dir):
    prompts = _prompts(2)[:4]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ref = LLM(str(qwen3_dir), device="cpu", max_model_len=MAX_LEN).generate(prompts, params, use_tqdm=False)
    with LLM(str(qwen3_dir), device="cpu", max_model_len=MAX_LEN, tensor_parallel_size=2,
             data_parallel_size=2) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]


@pytest.mark.slow
def test_torchrun_rendezvous_gives_the_tp1_tokens(qwen3_dir, tmp_path):
    import json
    import socket
    import subprocess
    import sys

    prompts = tmp_path / "p.jsonl"
    lines = [json.dumps({"id": i, "prompt_token_ids": p}) for i, p in enumerate(_prompts()[:3])]
    prompts.write_text("\n".join(lines) + "\n")
    args = ["-m", "minillm", "generate", str(prompts), "--model", str(qwen3_dir), "--device", "cpu",
            "--set", "sampling.temperature=0", "--set", "sampling.max_tokens=6", "--set", "sampling.ignore_eos=true"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = dict(capture_output=True, text=True, timeout=240)
    ref = subprocess.run([sys.executable, *args], **run)
    tp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                         str(port), *args, "--tp", "2"], **run)
    assert ref.returncode == 0 and tp.returncode == 0, tp.stderr[-2000:]
    tokens = [[json.loads(line)["token_ids"] for line in out.stdout.splitlines()] for out in (ref, tp)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 3

"""On GPUs: the engine-core process and data-parallel replicas give the in-process engine's tokens; tensor
parallelism over NCCL gives the same tokens with decode CUDA graphs (which capture its all-reduces) as eagerly,
and the torch path in fp32 at TP=2 gives TP=1's tokens. Replicas and TP need two visible GPUs."""
import random

import pytest
import torch

from minillm import LLM, SamplingParams
from tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24)
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tp"), arch="qwen3", hidden=256, heads=8, kv_heads=2,
                                head_dim=128, intermediate=512, vocab=1024, seed=3, max_positions=1024)


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1024) for _ in range(n)] for n in (1, 7, 64, 300, 17, 129)]


def _tokens(path, **kw) -> list[list[int]]:
    # A fixed pool: earlier GPU tests in this process may still hold memory that a utilization-sized pool of
    # an engine process would count as taken.
    with LLM(str(path), max_model_len=512, num_kv_blocks=256, **kw) as llm:
        return [o.token_ids for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]


def test_engine_process_gives_the_in_process_tokens(ckpt):
    assert _tokens(ckpt, engine_process=True) == _tokens(ckpt)


@two_gpus
def test_two_replicas_give_the_in_process_tokens(ckpt):
    assert _tokens(ckpt, data_parallel_size=2) == _tokens(ckpt)


@two_gpus
def test_tp2_graphs_capture_the_all_reduces(ckpt):
    assert _tokens(ckpt, tensor_parallel_size=2) == _tokens(ckpt, tensor_parallel_size=2, enforce_eager=True)


@two_gpus
def test_tp2_torch_path_fp32_equals_tp1(ckpt):
    kw = dict(dtype="float32", kernels="torch")
    assert _tokens(ckpt, tensor_parallel_size=2, **kw) == _tokens(ckpt, **kw)

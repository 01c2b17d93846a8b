"""The bench floor of a mixture-of-experts model counts only the experts a step touches: E * (1 - (1 - k/E)^B)
per layer in expectation under uniform routing."""
import pytest

from minillm.bench.floor import ModelShape, workload_work
from minillm.model.loader import resolve_arch


@pytest.fixture(scope="module")
def moe():
    return ModelShape.from_arch(resolve_arch("qwen3-30b-a3b"))


def test_experts_touched_formula(moe):
    assert moe.experts_touched(1) == pytest.approx(8.0)
    assert moe.experts_touched(2) == pytest.approx(128 * (1 - (120 / 128) ** 2))
    assert 125 < moe.experts_touched(64) < 126.5 and moe.experts_touched(None) == 128
    assert moe.experts_touched(10**6) == pytest.approx(128)


def test_30b_a3b_step_bytes_at_batch_1_and_64(moe):
    one, sixty_four, every = (moe.step_weight_bytes(2, b) for b in (1, 64, None))
    assert 5.9e9 < one < 6.2e9                       # about 6 GB at B = 1 (the figure)
    assert 0.98 * every < sixty_four < every         # nearly all of it at B = 64
    assert 60e9 < every < 61.1e9                     # 61 GB of weights, less the embedding gather


def test_dense_models_are_unchanged():
    dense = ModelShape.from_arch(resolve_arch("qwen3-0.6b"))
    assert dense.num_moe_layers == 0 and dense.step_weight_bytes(2, 1) == dense.step_weight_bytes(2, 256)
    h, i, layers = 1024, 3072, 28
    attn = (h * (16 * 128 + 2 * 8 * 128) + 16 * 128 * h) * layers
    assert dense.layer_matmul_params == attn + 3 * h * i * layers


def test_transformers_config_gives_the_same_shape(moe):
    from transformers import Qwen3MoeConfig
    hf = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                        num_experts_per_tok=8, moe_intermediate_size=768)
    assert ModelShape.from_arch(hf) == moe
    sparse = ModelShape.from_arch(Qwen3MoeConfig(num_hidden_layers=6, mlp_only_layers=[0], decoder_sparse_step=2))
    assert sparse.num_moe_layers == 3   # layers 1, 3, 5


def test_prefill_flops_count_k_experts_not_all(moe):
    work = workload_work(moe, [1000], [1], 2, 1)
    per_token = moe.attention_params + 48 * 8 * 3 * 2048 * 768 + 48 * 128 * 2048
    assert moe.layer_matmul_params == per_token
    assert work.prefill_flops >= 2 * per_token * 1000
    # the mean decode batch picks the experts: 64 requests stepping together read more than one request alone
    alone = workload_work(moe, [10], [100], 2, 64)
    together = workload_work(moe, [10] * 64, [100] * 64, 2, 64)
    assert together.num_steps == alone.num_steps == 100
    assert together.weight_bytes > 9 * alone.weight_bytes

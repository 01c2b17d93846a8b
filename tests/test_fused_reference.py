"""CPU checks of the references the fused CUDA kernels are tested against: each torch path in fused_ops.py
against a straightforward float64 formula (or transformers' Qwen3 code), and the sampler's numpy reference
against Philox known answers and the softmax it must sample from."""
import math

import numpy as np
import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding, apply_rotary_pos_emb

from minillm.ops import fused_ops
from minillm.ops.sampling_ops import philox4x32_10, race_noise, sample_exponential_race, sample_exponential_race_ref


def _rms_formula(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rms_norm_ref_matches_formula(dtype, atol):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    out = fused_ops.rms_norm_ref(x, w, 1e-6)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), _rms_formula(x, w, 1e-6), atol=atol, rtol=atol)


def test_fused_add_rms_norm_rounds_the_sum_first():
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(5, 64, generator=g).bfloat16(), torch.randn(5, 64, generator=g).bfloat16()
    w = torch.rand(64, generator=g).bfloat16()
    normed, s = fused_ops.fused_add_rms_norm(x, r, w, 1e-6)
    expected_sum = (x.float() + r.float()).bfloat16()  # HF's decoder layer adds in the activation dtype
    assert torch.equal(s, expected_sum)
    assert torch.equal(normed, fused_ops.rms_norm_ref(expected_sum, w, 1e-6))
    first_normed, first_sum = fused_ops.fused_add_rms_norm(x, None, w, 1e-6)
    assert first_sum is x and torch.equal(first_normed, fused_ops.rms_norm_ref(x, w, 1e-6))


def test_silu_and_mul_matches_formula():
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(6, 2 * 40, generator=g)
    gate, up = gate_up.double()[:, :40], gate_up.double()[:, 40:]
    expected = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(fused_ops.silu_and_mul(gate_up).double(), expected, atol=1e-6, rtol=1e-6)


def _qwen3_config(head_dim: int, theta: float) -> Qwen3Config:
    return Qwen3Config(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                       max_position_embeddings=4096, rope_theta=theta)


@pytest.mark.parametrize("head_dim,theta", [(64, 10000.0), (128, 1e6)])
def test_rope_cache_is_bit_identical_to_transformers(head_dim, theta):
    rope = Qwen3RotaryEmbedding(_qwen3_config(head_dim, theta))
    positions = torch.tensor([[0, 1, 2, 17, 1000, 4095]])
    cos, sin = rope(torch.zeros(1, dtype=torch.float32), positions)
    cache = fused_ops.rope_cos_sin_cache(head_dim, 4096, theta)
    half = head_dim // 2
    assert cache.shape == (4096, head_dim) and cache.dtype == torch.float32
    assert torch.equal(cache[positions[0], :half], cos[0, :, :half])
    assert torch.equal(cache[positions[0], half:], sin[0, :, :half])


@pytest.mark.parametrize("with_norm", [True, False])
def test_qk_norm_rope_ref_matches_transformers_qwen3(with_norm):
    hq, hkv, d, t, eps = 4, 2, 64, 9, 1e-6
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    positions = torch.randint(0, 4096, (t,), generator=g)
    qw, kw = (None, None)
    if with_norm:
        qw, kw = 1 + 0.1 * torch.randn(d, generator=g), 1 + 0.1 * torch.randn(d, generator=g)
    cache = fused_ops.rope_cos_sin_cache(d, 4096, 1e6)
    q, k, v = fused_ops.qk_norm_rope(qkv, positions, cache, hq, hkv, d, qw, kw, eps)

    hq_in, hk_in, hv_in = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    hq_in, hk_in = hq_in.view(1, t, hq, d), hk_in.view(1, t, hkv, d)
    if with_norm:
        q_norm, k_norm = Qwen3RMSNorm(d, eps), Qwen3RMSNorm(d, eps)
        q_norm.weight.data.copy_(qw)
        k_norm.weight.data.copy_(kw)
        hq_in, hk_in = q_norm(hq_in), k_norm(hk_in)
    cos, sin = Qwen3RotaryEmbedding(_qwen3_config(d, 1e6))(qkv, positions[None])
    q_hf, k_hf = apply_rotary_pos_emb(hq_in.transpose(1, 2), hk_in.transpose(1, 2), cos, sin)
    torch.testing.assert_close(q, q_hf[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, k_hf[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    assert torch.equal(v, hv_in.view(t, hkv, d))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that NaN compares equal to the same NaN."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("slots", [
    [5, -1, 0, 12, -1, 3, 15, 9],   # a skipped slot, and one past the tokens (9) that must not be written
    [-1, 7, -1, 2, 1, 8, 4],       # the first token skipped
    [-1] * 7,                      # nothing stored
])
def test_qk_norm_rope_ref_cache_out_is_unfused_plus_scatter(dtype, with_norm, slots):
    """kv_cache_out: q as unfused, k/v rows of the first T slots written into the caches, nothing else touched."""
    hq, hkv, d, t, eps = 4, 2, 64, 7, 1e-6
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    positions = torch.randint(0, 4096, (t,), generator=g)
    qw, kw = (1 + 0.1 * torch.randn(2, d, generator=g)).to(dtype) if with_norm else (None, None)
    cos_sin = fused_ops.rope_cos_sin_cache(d, 4096, 1e6)
    q_ref, k_ref, v_ref = fused_ops.qk_norm_rope(qkv, positions, cos_sin, hq, hkv, d, qw, kw, eps)
    k_cache = torch.full((4, 4, hkv, d), float("nan"), dtype=dtype)   # 16 slots
    v_cache = torch.full_like(k_cache, float("nan"))
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for row, slot in enumerate(slots[:t]):
        if slot >= 0:
            expected_k.view(-1, hkv, d)[slot] = k_ref[row]
            expected_v.view(-1, hkv, d)[slot] = v_ref[row]

    q, k, v = fused_ops.qk_norm_rope(qkv, positions, cos_sin, hq, hkv, d, qw, kw, eps,
                                     kv_cache_out=(k_cache, v_cache, torch.tensor(slots)))
    assert k is None and v is None
    assert torch.equal(q, q_ref)
    assert torch.equal(_bits(k_cache), _bits(expected_k))
    assert torch.equal(_bits(v_cache), _bits(expected_v))


def test_backends_fuse_the_kv_write_only_where_the_plan_says():
    """The CUDA backend hands qk_norm_rope the cache exactly when the plan fused the write (fuse_kv_write: the
    attention kernels cover the cache and the RoPE kernel runs, tests/test_plan.py); the torch backend never does.
    (The fused write itself needs CUDA tensors: tests/test_fused_gpu.py.)"""
    from minillm.attention import cuda_backend
    from minillm.attention.torch_backend import TorchAttentionBackend

    qkv, k_cache, v_cache = torch.zeros(3, (4 + 2 * 2) * 64), torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 64)
    meta = type("Meta", (), {"slot_mapping": torch.zeros(3, dtype=torch.long)})()
    target = cuda_backend.CudaAttentionBackend(fuse_kv_write=True).fused_kv_write_target(qkv, 4, 64, k_cache,
                                                                                          v_cache, meta)
    assert target[0] is k_cache and target[1] is v_cache and target[2] is meta.slot_mapping
    assert cuda_backend.CudaAttentionBackend(fuse_kv_write=False).fused_kv_write_target(
        qkv, 4, 64, k_cache, v_cache, meta) is None
    assert TorchAttentionBackend().fused_kv_write_target(qkv, 4, 64, k_cache, v_cache, meta) is None


@pytest.mark.parametrize("args,expect", [
    ((128, 16, 8, 16, "bfloat16"), None),
    ((64, 14, 2, 32, "float16"), None),
    ((128, 32, 2, 32, "float16"), None),            # a group of 16: the 16 rows of the decode kernel's mma tile
    ((96, 16, 8, 16, "bfloat16"), "head_dim=96"),
    ((128, 16, 8, 8, "bfloat16"), "block_size=8"),
    ((128, 16, 8, 16, "float32"), "dtype"),
    ((128, 34, 2, 16, "bfloat16"), "group"),
    ((128, 12, 8, 16, "bfloat16"), "group"),
])
def test_attention_coverage_names_the_shapes_its_kernels_do_not_cover(args, expect):
    from minillm.ops.attention_ops import COVERAGE

    d, hq, hkv, bs, dtype = args
    reason = COVERAGE.reason(dtype=dtype, capability=(9, 0), head_dim=d, num_q_heads=hq, num_kv_heads=hkv,
                             block_size=bs)
    assert reason is None if expect is None else expect in reason
    assert "KV-cache dtype" in COVERAGE.reason(dtype="bfloat16", capability=(9, 0), kv_dtype="float16")
    assert COVERAGE.reason(dtype="bfloat16", capability=(9, 0), kv_dtype="bfloat16") is None
    assert "sm_80" in COVERAGE.reason(dtype="bfloat16", capability=(7, 5))


# Random123's published known answers for Philox4x32-10 (counter, key, output).
_PHILOX_KAT = [
    ([0, 0, 0, 0], (0, 0), [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, (0xFFFFFFFF, 0xFFFFFFFF), [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], (0xA4093822, 0x299F31D0),
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
]


@pytest.mark.parametrize("counter,key,expected", _PHILOX_KAT)
def test_philox_known_answers(counter, key, expected):
    assert philox4x32_10(np.array(counter, dtype=np.uint32), key).tolist() == expected


def test_seeded_noise_twins_give_the_same_words():
    """The seeded rows' uniforms: the numpy reference and the torch twin (for a GPU without the kernel) agree bit
    for bit, negative and 64-bit seeds, positions past 32 bits, an offset and an odd vocab included; a row's
    uniforms depend on (seed, position) only."""
    from minillm.ops.sampling_ops import seeded_uniform_ref, seeded_uniform_torch

    args = np.array([[4, 0, 9], [-3, 2**62 + 11, 7], [0, 2**33 + 5, 123]], dtype=np.int64)
    for vocab, offset in ((1001, 0), (6, 2), (4096, 2**32)):
        ref = seeded_uniform_ref(args, vocab, offset)
        assert ref.dtype == np.float32 and (ref > 0).all() and (ref <= 1).all()
        assert torch.equal(seeded_uniform_torch(torch.from_numpy(args), vocab, offset), torch.from_numpy(ref))
    moved = args[:, [2, 0, 1]].copy()
    moved[0] = [0, 1, 2]                                  # other rows, same (seed, position)
    assert np.array_equal(seeded_uniform_ref(moved, 64), seeded_uniform_ref(args, 64)[[2, 0, 1]])
    assert np.mean(seeded_uniform_ref(args, 4096)[0] == seeded_uniform_ref(args, 4096, 1)[0]) < 0.01


def test_race_noise_is_gumbel_and_keyed():
    noise = race_noise(range(8), 4096, seed=5, offset=3).astype(np.float64)
    assert noise.shape == (8, 4096) and np.isfinite(noise).all()
    # -log(E), E ~ Exp(1), is standard Gumbel: mean = Euler's gamma, variance = pi^2 / 6.
    assert abs(noise.mean() - 0.5772) < 0.03
    assert abs(noise.var() - math.pi**2 / 6) < 0.08
    assert np.array_equal(noise, race_noise(range(8), 4096, seed=5, offset=3))
    assert np.array_equal(noise[3:5], race_noise(range(3, 5), 4096, seed=5, offset=3))
    for other in (race_noise(range(8), 4096, seed=6, offset=3), race_noise(range(8), 4096, seed=5, offset=4)):
        assert np.mean(noise == other) < 0.01


def test_greedy_rows_take_the_argmax():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 50, generator=g)
    logits[2, 7] = logits[2, 9] = 10.0  # a tie goes to the first column, as in torch.argmax
    inv_t = torch.tensor([0.0, 1.0, 0.0, 2.0, 0.0, 0.5])
    out = sample_exponential_race(logits, inv_t, seed=1, offset=0)
    assert out.dtype == torch.int64 and out.shape == (6,)
    greedy = inv_t == 0
    assert torch.equal(out[greedy], logits.argmax(dim=1)[greedy])
    assert out[2].item() == 7


@pytest.mark.parametrize("inv_t", [1.0, 2.5])
def test_sampled_frequencies_follow_softmax(inv_t):
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5, float("-inf"), -3.0, 1.5])
    n = 20000  # one draw per row: every row has its own counters
    tokens = sample_exponential_race_ref(logits.expand(n, -1).contiguous(), torch.full((n,), inv_t), 11, 0)
    freq = torch.bincount(tokens, minlength=8).double() / n
    p = torch.softmax(logits.double() * inv_t, dim=0)
    assert freq[5] == 0  # a masked (-inf) logit is never drawn
    assert (freq - p).abs().max() < 4 * math.sqrt(0.25 / n)


def test_offsets_give_fresh_draws():
    logits = torch.zeros(64, 1000)
    inv_t = torch.ones(64)
    a = sample_exponential_race(logits, inv_t, seed=0, offset=0)
    assert torch.equal(a, sample_exponential_race(logits, inv_t, seed=0, offset=0))
    assert (a != sample_exponential_race(logits, inv_t, seed=0, offset=1)).float().mean() > 0.9


@pytest.mark.parametrize("kwargs,field", [
    (dict(logits=torch.zeros(2, 4, dtype=torch.float64)), "logits"),
    (dict(logits=torch.zeros(4)), "logits"),
    (dict(inv_temperature=torch.ones(3)), "inv_temperature"),
    (dict(seed=-1), "seed"),
    (dict(offset=2**63), "offset"),
])
def test_bad_arguments_raise_value_error(kwargs, field):
    args = dict(logits=torch.zeros(2, 4), inv_temperature=torch.ones(2), seed=0, offset=0) | kwargs
    with pytest.raises(ValueError, match=field):
        sample_exponential_race(**args)

"""FP8 KV cache on the CPU: the quantize/dequantize arithmetic, the torch attention path against a reference that
dequantizes the whole cache, the engine's invariances (chunked prefill, prefix hits, preemption) under fp8,
checkpoint scales, and the configuration errors."""
import random

import pytest
import torch

from minillm.diagnostics import paged_meta
from minillm import LLM, SamplingParams
from minillm.attention.torch_backend import TorchAttentionBackend
from minillm.cache.spec import KVCacheSpec
from minillm.config import ConfigError
from minillm.model.arch import ModelArchConfig
from minillm.model.loader import read_kv_scales
from minillm.ops.kv_quant import FP8_KERNEL_COVERAGE, dequantize, quantize
from minillm.ops.reference import kv_write_ref, make_paged_batch, paged_attention_ref
from tiny_models import make_tiny_checkpoint, with_tensors

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
GREEDY = dict(temperature=0.0, ignore_eos=True)


# ---------------------------------------------------------------- quantize / dequantize

@pytest.mark.parametrize("dtype, top", [(E4M3, 448.0), (E5M2, 57344.0)])
def test_saturation_edges_and_non_finite(dtype, top):
    scale = torch.tensor([1.0, 2.0])
    x = torch.tensor([[top, top * 1.01, 1e30, float("inf"), -float("inf"), -top * 3, float("nan"), 0.0]] * 2)
    x = x[None]                                                  # [T=1, H=2, D=8]
    got = dequantize(quantize(x, scale, dtype), scale)[0]
    # head 0 (scale 1): everything past the range lands on +-top; head 1 (scale 2) holds up to 2 * top
    assert got[0, :6].tolist() == [top, top, top, top, -top, -top]
    assert got[1, 0] == top and got[1, 2:6].tolist() == [2 * top, 2 * top, -2 * top, -2 * top]
    assert torch.isnan(got[:, 6]).all() and (got[:, 7] == 0).all()


def test_round_trip_error_is_within_half_an_ulp():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 32, generator=gen) * 10
    scale = torch.tensor([0.5, 1.0, 3.0, 0.05])
    back = dequantize(quantize(x, scale, E4M3), scale)
    ratio = x.abs() / scale[:, None]
    normal = (ratio >= 2 ** -6) & (ratio <= 448)                  # e4m3's normal range (the rest saturates)
    assert (~normal).any() and normal.any()
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max() <= 2 ** -4 + 1e-6                            # 3 mantissa bits: half an ulp is 2^-4
    # values that fit exactly come back exactly (whole numbers up to 16 times the scale)
    exact = torch.arange(-16, 17).float()[None, None, :].expand(1, 4, 33) * scale[:, None]
    assert torch.equal(dequantize(quantize(exact, scale, E4M3), scale), exact)


# ---------------------------------------------------------------- the torch path against a full dequantization

def _fp8_spec(num_blocks: int, dtype=E4M3):
    arch = ModelArchConfig.from_hf_dict({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64,
                                         "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
                                         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                         "max_position_embeddings": 256})
    gen = torch.Generator().manual_seed(1)
    scales = 0.02 + torch.rand(2, 2, 2, generator=gen)
    spec = KVCacheSpec.for_model(arch, 16, "fp8" if dtype == E4M3 else "fp8_e5m2", torch.float32, scales)
    return spec, spec.allocate(num_blocks, "cpu")


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_torch_backend_matches_a_fully_dequantized_cache(dtype):
    ctx, qlens = [1, 17, 40, 33, 64], [1, 1, 40, 5, 16]         # two decodes, a prefill, a prefix hit, a chunk
    b = make_paged_batch(ctx, qlens, 4, 2, 16, 16, torch.float32, seed=2)
    spec, caches = _fp8_spec(b.k_cache.shape[0], dtype)
    layer = 1
    k_cache, v_cache = caches[layer]
    ks, vs = spec.layer_scales(k_cache)
    # The earlier tokens go in through the quantizing write; unowned slots stay NaN in the cache itself.
    k_cache.copy_(torch.full_like(k_cache, float("nan"), dtype=torch.float32).to(dtype))
    v_cache.copy_(k_cache)
    owned = ~torch.isnan(b.k_cache.view(-1, 2, 16)[:, 0, 0])
    slots = torch.nonzero(owned)[:, 0]
    kv_write_ref(b.k_cache.view(-1, 2, 16)[slots], b.v_cache.view(-1, 2, 16)[slots], k_cache, v_cache, slots, ks, vs)
    backend = TorchAttentionBackend()
    backend.bind_kv_cache(spec)
    out = backend.forward(b.q, b.k, b.v, k_cache, v_cache, paged_meta(b, num_decodes=2), 0.25)
    # Reference: dequantize the whole cache after the write, attend in fp32 over the dequantized copy.
    kf, vf = dequantize(k_cache, ks), dequantize(v_cache, vs)
    want = paged_attention_ref(b.q, kf, vf, b.block_tables, b.seq_lens_list, b.query_start_list, 0.25)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    # and the new rows were stored quantized, bit for bit
    stored = k_cache.view(-1, 2, 16)[b.slot_mapping]
    assert torch.equal(stored.view(torch.uint8), quantize(b.k, ks, dtype).view(torch.uint8))


def test_an_fp8_cache_from_elsewhere_is_refused():
    spec, _ = _fp8_spec(4)
    with pytest.raises(ValueError, match="did not allocate"):
        spec.layer_scales(torch.zeros(4, 16, 2, 16, dtype=E4M3))


def test_fp8_halves_the_bytes_per_block():
    spec, _ = _fp8_spec(1)
    bf16 = KVCacheSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size, torch.bfloat16)
    assert spec.bytes_per_block * 2 == bf16.bytes_per_block == 2 * 2 * 2 * 16 * 16 * 2


# ---------------------------------------------------------------- the engine under fp8

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fp8"), arch="qwen3", vocab=256, seed=1)


def _run(path, prompts, **kw):
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=96, kv_cache_dtype="fp8",
              check_integrity=True, **kw)
    return llm, [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, **GREEDY),
                                                    use_tqdm=False)]


def _prompts(seed):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in (5, 17, 33, 40, 1, 60)]


def test_chunking_prefix_hits_and_preemption_are_token_exact_under_fp8(ckpt):
    prompts = _prompts(3)
    _, whole = _run(ckpt, prompts, enable_chunked_prefill=False, max_num_batched_tokens=96)
    for budget in (4, 16):
        assert _run(ckpt, prompts, max_num_batched_tokens=budget)[1] == whole
    llm, got = _run(ckpt, prompts, num_kv_blocks=14, max_num_batched_tokens=32)
    assert llm.num_preemptions > 0 and got == whole
    # prefix hits: the second pass reads the shared blocks the first wrote (quantized) and must agree
    llm, first = _run(ckpt, prompts)
    again = llm.generate(prompts, SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)
    assert sum(o.num_cached_tokens for o in again) > 0
    assert [o.token_ids for o in again] == first == whole


# ---------------------------------------------------------------- checkpoint scales and configuration errors

def test_checkpoint_scales_are_read_per_tensor_and_per_head(ckpt, tmp_path):
    d = with_tensors(ckpt, tmp_path / "s", {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
        "model.layers.0.self_attn.v_scale": torch.tensor([0.25, 0.125]),
        "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([2.0])})
    arch = ModelArchConfig.from_dir(d)
    s = read_kv_scales(d, arch)
    assert s.tolist() == [[[0.5, 0.5], [0.25, 0.125]], [[2.0, 2.0], [1.0, 1.0]]]
    llm = LLM(str(d), device="cpu", dtype="float32", max_model_len=96, kv_cache_dtype="fp8")
    assert torch.equal(llm.engine.runner.kv_spec.scales.cpu(), s)
    assert read_kv_scales(ckpt, arch) is None


@pytest.mark.parametrize("tensor, words", [
    (torch.ones(3), ["k_scale", "shape [3]", "[2] (per KV head)"]),
    (torch.tensor(-1.0), ["finite and > 0"]),
])
def test_bad_checkpoint_scales_exit_2(ckpt, tmp_path, tensor, words):
    from test_cli import run_cli
    d = with_tensors(ckpt, tmp_path / "bad", {"model.layers.1.self_attn.k_scale": tensor})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2, 3], "max_tokens": 2}\n')
    result = run_cli("generate", prompts, "--model", d, "--kv-cache-dtype", "fp8", "--device", "cpu")
    assert result.exit_code == 2 and result.stdout == ""
    for w in words:
        assert w in result.stderr


def test_unknown_kv_cache_dtype_exits_2(tmp_path):
    from test_cli import run_cli
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    result = run_cli("generate", prompts, "--kv-cache-dtype", "fp4")
    assert result.exit_code == 2 and "cache.kv_cache_dtype='fp4'" in result.stderr and "fp8_e5m2" in result.stderr


def test_the_coverage_statement_names_the_megakernel_as_the_one_kernel_without_fp8():
    from minillm.ops.kv_quant import kernels_refusing_fp8
    assert kernels_refusing_fp8() == ["decode_megakernel"]


# ---------------------------------------------------------------- the floor counts the cache's real bytes

def test_fp8_floor_reads_half_the_kv_bytes_and_states_the_bf16_one():
    from minillm.bench.floor import DeviceRates, ModelShape, floor_record, kv_elem_bytes, workload_work
    shape = ModelShape(151936, 1024, 3072, 28, 16, 8, 128)
    assert (kv_elem_bytes("fp8", "bfloat16"), kv_elem_bytes("auto", "bfloat16"), kv_elem_bytes("fp8_e5m2", "float32")) \
        == (1, 2, 1)
    bf16 = workload_work(shape, [100, 300], [50, 20], 2, 256)
    fp8 = workload_work(shape, [100, 300], [50, 20], 2, 256, kv_elem_bytes("fp8", "bfloat16"))
    assert fp8.kv_bytes * 2 == bf16.kv_bytes and fp8.weight_bytes == bf16.weight_bytes
    rec = floor_record(fp8, DeviceRates(4e12, 7e14, 0.0), 1.0, bf16)
    assert rec["kv_bytes_model_dtype_kv"] == bf16.kv_bytes
    assert rec["floor_s"] < rec["floor_s_model_dtype_kv"]
    assert rec["floor_s_model_dtype_kv"] - rec["floor_s"] == pytest.approx(fp8.kv_bytes / 4e12)
    assert "floor_s_model_dtype_kv" not in floor_record(bf16, DeviceRates(4e12, 7e14, 0.0), 1.0, bf16)


def test_the_fp8_check_batch_keeps_its_nan_poison_and_saturates_on_write():
    from minillm.diagnostics.kv_quant_check import fp8_batch
    b, ks, vs = fp8_batch([21, 40], [21, 9], 4, 2, 64, 16, torch.bfloat16, E4M3, device="cpu")
    assert b.k_cache.dtype == E4M3 and torch.isnan(b.k_cache.float()).any()
    kv_write_ref(b.k, b.v, b.k_cache, b.v_cache, b.slot_mapping, ks, vs)
    first = dequantize(b.k_cache.view(-1, 2, 64)[b.slot_mapping[0]], ks)[0, :4]
    assert first.tolist() == pytest.approx([448 * ks[0].item(), -448 * ks[0].item()] * 2)
    assert sorted(FP8_KERNEL_COVERAGE) == sorted(["kv_write", "qk_norm_rope_cache", "paged_decode", "paged_prefill",
                                                  "decode_megakernel", "torch"])


def test_an_fp8_pool_holds_twice_the_tokens_of_a_bf16_one():
    blocks = {}
    for kv in ("auto", "fp8"):
        llm = LLM(dtype="bfloat16", device="cpu", kv_cache_dtype=kv)   # the demo model; the CPU pool is byte-capped
        blocks[kv] = llm.engine.runner.num_blocks
        assert llm.engine.runner.kv_caches[0][0].dtype == (E4M3 if kv == "fp8" else torch.bfloat16)
    assert blocks["fp8"] == 2 * blocks["auto"]

"""FP8 KV-cache kernels against the torch path (skipped without a GPU): the check-kernels fp8 cases, the CUDA
backend against the torch backend on a mixed batch, and the engine with an fp8 cache on the CUDA kernels."""
import pytest
import torch

from minillm.diagnostics import paged_meta
from minillm.ops.kv_quant import FP8_DTYPES

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ext():
    from minillm.ops.build import load_extension
    return load_extension()


def test_every_fp8_kernel_case_passes(ext):
    from minillm.diagnostics.kv_quant_check import run_fp8_cases
    rows = run_fp8_cases(quick=False)
    failed = [r for r in rows if not r["passed"]]
    assert rows and not failed, failed[:5]


@pytest.mark.parametrize("mode", ["split", "unified"])
@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_cuda_backend_matches_torch_backend_on_a_mixed_batch(ext, kv, mode):
    from minillm.attention.cuda_backend import CudaAttentionBackend
    from minillm.attention.torch_backend import TorchAttentionBackend
    from minillm.cache.spec import KVCacheSpec
    from minillm.ops.kv_quant import dequantize, quantize
    from minillm.ops.reference import make_paged_batch
    ctx, ql = [40, 1000, 17, 300, 64], [1, 1, 17, 120, 64]
    b = make_paged_batch(ctx, ql, 16, 8, 128, 16, torch.bfloat16, "cuda", seed=4)
    spec = KVCacheSpec(1, 8, 128, 16, FP8_DTYPES[kv], scales=(0.01 + 0.02 * torch.rand(1, 2, 8)))
    outs = []
    for backend in (CudaAttentionBackend(mode), TorchAttentionBackend()):
        backend.bind_kv_cache(spec)
        (kc, vc), = spec.allocate(b.k_cache.shape[0], "cuda")
        ks, vs = spec.layer_scales(kc)
        kc.copy_(quantize(b.k_cache, ks, kc.dtype))   # the earlier tokens (NaN where unowned)
        vc.copy_(quantize(b.v_cache, vs, vc.dtype))
        outs.append((backend.forward(b.q, b.k, b.v, kc, vc, paged_meta(b, num_decodes=2), 128 ** -0.5), kc, vc))
    (out, kc, vc), (ref, kr, vr) = outs
    # the new rows were written by the fused-less kv_write_fp8 (k, v given): the same bytes as the reference
    owned = ~torch.isnan(dequantize(kr, spec.scales[0, 0]))
    assert torch.equal(kc.view(torch.uint8)[owned], kr.view(torch.uint8)[owned])
    assert torch.isnan(dequantize(kc, spec.scales[0, 0])[~owned]).all()
    assert (out.float() - ref.float()).abs().max() < 2e-2


def test_engine_with_an_fp8_cache_on_the_kernels(tmp_path):
    from minillm import LLM, SamplingParams
    from tiny_models import make_tiny_checkpoint
    path = make_tiny_checkpoint(tmp_path / "m", hidden=256, heads=4, kv_heads=2, head_dim=64, vocab=512)
    prompts = [[(7 * i + j) % 512 for j in range(n)] for i, n in enumerate((5, 40, 300, 17))]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    runs = {}
    for attention in ("cuda", "torch"):
        llm = LLM(str(path), dtype="bfloat16", kv_cache_dtype="fp8", attention=attention, max_model_len=512,
                  max_num_batched_tokens=64)
        assert llm.engine.runner.kv_spec.quantized
        assert llm.engine.runner.megakernel is None
        runs[attention] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        del llm
    assert all(len(t) == 24 for t in runs["cuda"])
    # bf16 kernels and the fp32 reference may split near-ties differently; most tokens agree
    same = sum(a == b for x, y in zip(runs["cuda"], runs["torch"]) for a, b in zip(x, y))
    assert same >= 0.75 * 4 * 24

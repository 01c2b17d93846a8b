"""The decode megakernel (torch.ops.minillm.decode_megakernel) against the model's torch path on an sm_90 GPU.

Each case: a random model, a decode step over ragged contexts (1, block edges, long), random block tables, NaN in
every unowned cache slot, padded rows (slot -1). Checked (minillm/diagnostics/megakernel_check.py: compare): hidden rows
within bf16 tolerance of the reference, the new k/v slots likewise, every other slot bit-identical (NaN stays
NaN), and a CUDA-graph replay from the same caches bit-identical to the eager launch. Skipped without CUDA."""
import zlib

import pytest
import torch

from minillm.diagnostics import megakernel_check as chk

pytestmark = pytest.mark.gpu

_MODELS: dict = {}


@pytest.fixture(scope="module", autouse=True)
def ext():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the megakernel needs sm_90")
    from minillm.ops.build import load_extension

    load_extension()


def _model(key, arch, dtype):
    if key not in _MODELS:
        _MODELS[key] = chk.random_model(arch, dtype, seed=len(_MODELS))
    return _MODELS[key]


SHAPES = {
    "qwen3-d64-g2": (chk.tiny_arch("qwen3"), torch.bfloat16, 16),
    "qwen3-d128-g4-bs32": (chk.tiny_arch("qwen3", hidden=512, inter=1024, heads=8, kv_heads=2, head_dim=128),
                           torch.bfloat16, 32),
    "qwen3-d64-g16": (chk.tiny_arch("qwen3", heads=16, kv_heads=1, inter=256), torch.bfloat16, 32),
    "qwen2-d64-g8-bias": (chk.tiny_arch("qwen2", hidden=512, inter=1024, heads=8, kv_heads=1), torch.bfloat16, 16),
    "qwen3-d128-g1-fp16": (chk.tiny_arch("qwen3", hidden=256, inter=768, heads=4, kv_heads=4, head_dim=128, layers=3),
                           torch.float16, 16),
}
BATCHES = {
    "B1-ctx1": ([1], 0),
    "B1-ctx17": ([17], 0),
    "B2": ([16, 33], 0),
    "B3-long": ([1, 2049, 6000], 0),
    "B8-edges": ([15, 16, 17, 31, 32, 33, 64, 65], 0),
    "B16-pad": ([1, 2, 5, 16, 17, 100, 127, 128, 129, 255, 256, 257, 511, 3000], 2),
}


@pytest.mark.parametrize("shape", ["qwen3-d128-g4-bs32", "qwen2-d64-g8-bias"])
def test_phase_by_phase_one_layer(shape):
    """Each phase's output in the kernel's workspaces against the torch path step by step (one layer): when the
    end-to-end tests fail, the first phase listed here that fails is where to look. First in the file: a kernel
    that traps leaves the CUDA context unusable for every test after it."""
    import dataclasses

    arch, dtype, bs = SHAPES[shape]
    arch1 = dataclasses.replace(arch, num_hidden_layers=1)
    model = _model(shape + "-1layer", arch1, dtype)
    case = chk.make_decode_case(arch1, [1, 40, 700, 3000], 0, bs, dtype, seed=3)
    errs = chk.phase_errors(model, case, bs)
    print(shape, errs)
    for phase in ("qkv", "attn", "swiglu", "resid", "out"):
        assert errs[phase] <= chk.TOL[dtype], (phase, errs)


def _check(res):
    assert res["untouched_slots_equal"], "a cache slot other than this step's new ones changed"
    assert res["graph_replay_equal"], "a CUDA-graph replay differs from the eager launch"
    assert res["hidden_rel_err"] <= res["tol"], res
    assert res["new_kv_rel_err"] <= res["tol"], res


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_matches_torch_path(shape, batch):
    arch, dtype, bs = SHAPES[shape]
    ctx, pad = BATCHES[batch]
    case = chk.make_decode_case(arch, ctx, pad, bs, dtype, seed=zlib.crc32(f"{shape} {batch}".encode()) % 1000)
    res = chk.compare(_model(shape, arch, dtype), case, bs)
    print(shape, batch, res)
    _check(res)


@pytest.mark.parametrize("ctx,pad", [([128], 0), ([8192], 0), ([100, 1, 700, 2048, 31, 5000, 16, 333], 0),
                                     ([2048] * 12 + [1, 4000], 2)])
def test_qwen3_0_6b_shape(ctx, pad):
    arch = chk.qwen3_0_6b_arch()
    case = chk.make_decode_case(arch, ctx, pad, 16, torch.bfloat16, seed=len(ctx))
    res = chk.compare(_model("0.6b", arch, torch.bfloat16), case, 16)
    print("0.6b", len(ctx), res)
    _check(res)


def test_partition_sizes_agree():
    """One partition per sequence, or many (a merge of up to ~60 partials per head): the same answer."""
    from minillm.ops.megakernel import DecodeMegakernel

    arch, dtype, bs = SHAPES["qwen3-d64-g2"]
    model = _model("qwen3-d64-g2", arch, dtype)
    case = chk.make_decode_case(arch, [4000, 37], 0, bs, dtype, seed=5)
    outs = []
    for chunks in (1, 1 << 20):
        caches = [(k.clone(), v.clone()) for k, v in case.caches]
        mk = DecodeMegakernel(model, caches, 2, bs, 16384, min_partition_chunks=chunks)
        outs.append(mk.forward(case.input_ids, case.positions, case.meta).float().clone())
    err = ((outs[0] - outs[1]).norm() / outs[1].norm()).item()
    assert err < 1e-2, err


def test_graph_per_batch_size():
    """MegakernelGraphs: replays of captured graphs give the eager result for several batch sizes."""
    from minillm.ops.megakernel import DecodeMegakernel
    from minillm.runner.cuda_graphs import MegakernelGraphs

    arch, dtype, bs = SHAPES["qwen3-d64-g2"]
    model = _model("qwen3-d64-g2", arch, dtype)
    case = chk.make_decode_case(arch, [5, 40, 300], 0, bs, dtype, seed=9)
    caches = [(k.clone(), v.clone()) for k, v in case.caches]
    mk = DecodeMegakernel(model, caches, 4, bs, 16384)
    graphs = MegakernelGraphs(mk, max_blocks=case.meta.block_tables.shape[1])
    graphs.capture([1, 3, 4])
    eager = mk.forward(case.input_ids, case.positions, case.meta).clone()
    for (k, v), (k0, v0) in zip(caches, case.caches):
        k.copy_(k0)
        v.copy_(v0)
    assert graphs.bucket(3) == 3 and graphs.bucket(2) is None
    replayed = graphs.replay(case.input_ids, case.positions, case.meta)
    assert torch.equal(replayed.view(torch.int16), eager.view(torch.int16))


def test_bad_inputs_raise_value_error():
    from minillm.ops.megakernel import DecodeMegakernel

    arch, dtype, bs = SHAPES["qwen3-d64-g2"]
    model = _model("qwen3-d64-g2", arch, dtype)
    case = chk.make_decode_case(arch, [5, 6], 0, bs, dtype)
    mk = DecodeMegakernel(model, [(k.clone(), v.clone()) for k, v in case.caches], 2, bs, 16384)
    with pytest.raises(ValueError, match="seq_lens"):
        case.meta.seq_lens = case.meta.seq_lens.long()
        mk.forward(case.input_ids, case.positions, case.meta)
    with pytest.raises(ValueError, match="decode rows"):
        mk.forward(torch.zeros(3, dtype=torch.int64, device="cuda"), case.positions, case.meta)
    with pytest.raises(ValueError, match="does not cover"):
        DecodeMegakernel(model, case.caches, 17, bs, 16384)


"""CPU tests of the decode megakernel's pure-torch parts: weight and activation layouts (checked against an
emulation of the mma.sync fragment rules), the attention work split, the shared-memory plan, coverage and the
torch reference. The kernel itself: tests/test_megakernel_gpu.py."""
import json
from pathlib import Path

import pytest
import torch

from minillm.model.arch import ModelArchConfig
from minillm.ops import megakernel as mk
from minillm.ops.build import CUDA_DIR

PRESETS = Path(mk.__file__).resolve().parents[1] / "presets"


def _arch(name: str) -> ModelArchConfig:
    return ModelArchConfig.from_hf_dict(json.loads((PRESETS / f"{name}.json").read_text()))


def test_pack_granules_round_trip_and_lane_order():
    w = torch.arange(16 * 64, dtype=torch.float32).view(16, 64)
    packed = mk.pack_granules(w)
    assert torch.equal(mk.unpack_granules(packed, 16, 64), w)
    # Granule 1, k-pair 1, lane 4r + q = 4 * 3 + 2: W[8 + 3][32 + 8t + 2q + e] at 2t + e.
    lane = packed.view(2, 2, 32, 8)[1, 1, 14]
    expect = [w[11, 32 + 8 * t + 4 + e].item() for t in range(4) for e in range(2)]
    assert lane.tolist() == expect


def test_pack_rejects_ragged_shapes():
    with pytest.raises(ValueError, match="multiple"):
        mk.pack_granules(torch.zeros(12, 64))
    with pytest.raises(ValueError, match="multiple"):
        mk.pack_granules(torch.zeros(16, 48))


def test_gate_up_interleaves_matching_granules():
    inter, k = 16, 32
    w = torch.randn(2 * inter, k)
    packed = mk.pack_gate_up(w).view(inter // 8, 2, 8 * k)
    for j in range(inter // 8):
        assert torch.equal(mk.unpack_granules(packed[j, 0], 8, k), w[8 * j:8 * j + 8])
        assert torch.equal(mk.unpack_granules(packed[j, 1], 8, k), w[inter + 8 * j:inter + 8 * j + 8])


def test_act_fragment_index_is_a_permutation():
    k = 64
    m = torch.arange(16)[:, None].expand(16, k)
    kk = torch.arange(k)[None, :].expand(16, k)
    idx = mk.act_fragment_index(m, kk, k).reshape(-1)
    assert sorted(idx.tolist()) == list(range(16 * k))
    # Row 9, k-pair 0, quad position (26 % 8) // 2 = 1, word (k-step 1, high half) 3: u32 (9 * 2 * 4 + 1) * 4 + 3.
    assert mk.act_fragment_index(9, 26, k) == ((9 * 2 + 0) * 4 + 1) * 4 * 2 + 3 * 2 + 0
    # Row m's elements are one contiguous range (the kernel reads and writes only the live rows).
    assert set(mk.act_fragment_index(torch.tensor(3), torch.arange(k), k).tolist()) == set(range(3 * k, 4 * k))


@pytest.mark.parametrize("rows,n,k", [(1, 8, 32), (3, 16, 64), (16, 24, 96)])
def test_emulated_tensor_core_gemv_matches_matmul(rows, n, k):
    """The packed weights and the A fragments, read lane by lane with the PTX fragment rules, give x @ W^T."""
    g = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g)
    out = mk.emulate_gemv(mk.pack_granules(w), mk.pack_act_fragments(x), n, k)
    torch.testing.assert_close(out[:rows], x @ w.T, rtol=1e-5, atol=1e-4)
    assert torch.count_nonzero(out[rows:]) == 0
    # As gemv_global_a reads it: rows >= batch are stale (NaN here) and never loaded.
    act = mk.pack_act_fragments(x)
    act[rows * k:] = float("nan")
    out = mk.emulate_gemv(mk.pack_granules(w), None, n, k, a_words=mk.global_a_words(act, k, batch=rows))
    torch.testing.assert_close(out[:rows], x @ w.T, rtol=1e-5, atol=1e-4)
    assert torch.count_nonzero(out[rows:]) == 0


@pytest.mark.parametrize("kpairs", [1, 7, 64, 96, 100, 129, 200])
@pytest.mark.parametrize("batch", [1, 8, 9, 16])
def test_global_a_rounds_cover_every_k_pair_once(kpairs, batch):
    """gemv_global_a's loop (mirrored): every k-pair multiplied exactly once over the warps; down_proj of
    Qwen3-0.6B (96 k-pairs) takes one L2 round trip per warp at B <= 8, two above."""
    rounds = mk.global_a_rounds(kpairs, batch)
    done = sorted(kp for warp in rounds for r in warp for kp in r)
    assert done == list(range(kpairs))
    if kpairs == 96:
        assert max(len(w) for w in rounds) == (1 if batch <= 8 else 2)


def test_emulation_catches_a_wrong_layout():
    """The check above can fail: rows of W packed without the granule permutation give a different product."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 64, generator=g), torch.randn(16, 64, generator=g)
    wrong = mk.emulate_gemv(w.reshape(-1), mk.pack_act_fragments(x), 16, 64)
    assert not torch.allclose(wrong[:4], x @ w.T, atol=1e-2)


@pytest.mark.parametrize("rows,n,k", [(1, 8, 32), (5, 16, 64), (16, 24, 96)])
def test_emulated_gemv_from_the_shared_tile_matches_matmul(rows, n, k):
    """The norm output as the kernel stores it (row-major, rows padded to act_tile_stride, rows >= batch left as
    whatever the region held), read through the kernel's ldmatrix addressing, gives x @ W^T in the live rows."""
    g = torch.Generator().manual_seed(rows * n + k + 7)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g)
    stride = mk.act_tile_stride(k)
    tile = torch.full((16 * stride,), float("nan"))           # stale contents: never written for rows >= batch
    for m in range(rows):
        tile[m * stride:m * stride + k] = x[m]
    out = mk.emulate_gemv(mk.pack_granules(w), None, n, k, a_words=mk.ldmatrix_a_words(tile, k, stride))
    torch.testing.assert_close(out[:rows], x @ w.T, rtol=1e-5, atol=1e-4)


def test_shared_tile_emulation_catches_a_wrong_stride():
    """The same check with the tile read at an unpadded stride fails: the emulation follows the addresses."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(16, 64, generator=g), torch.randn(8, 64, generator=g)
    stride = mk.act_tile_stride(64)
    tile = torch.zeros(16 * stride)
    for m in range(16):
        tile[m * stride:m * stride + 64] = x[m]
    wrong = mk.emulate_gemv(mk.pack_granules(w), None, 8, 64, a_words=mk.ldmatrix_a_words(tile, 64, 64))
    assert not torch.allclose(wrong, x @ w.T, atol=1e-2)


@pytest.mark.parametrize("hidden", [32, 64, 96, 1024, 1536, 2048])
def test_shared_tile_reads_are_bank_conflict_free(hidden):
    """Every ldmatrix phase of gemv_smem_a addresses 8 different 16-byte bank groups with the padded stride (the
    norm's own 16-byte stores are consecutive chunks of a row, conflict-free by construction); without the pad
    every phase conflicts (the check can fail)."""
    assert all(len(set(ph)) == 8 for ph in mk.ldmatrix_bank_groups(hidden, mk.act_tile_stride(hidden)))
    assert all(len(set(ph)) < 8 for ph in mk.ldmatrix_bank_groups(hidden, hidden))


@pytest.mark.parametrize("seq_lens,hkv,ctas", [
    ([128], 8, 132), ([2048], 8, 132), ([1, 16, 17, 4096], 8, 132), ([8192], 1, 132), ([5] * 16, 8, 132),
    ([3000, 1, 33, 4100, 300], 2, 132), ([100] * 16, 8, 114), ([0, 7], 4, 20), ([9000, 9000], 8, 16),
])
def test_partition_plan_covers_every_token_once(seq_lens, hkv, ctas):
    plan = mk.partition_plan(seq_lens, hkv, ctas)
    assert plan.items == hkv * sum(plan.parts)
    if ctas > hkv * len(seq_lens):
        assert plan.items <= ctas, "split sequences keep their partial rows in one row per CTA"
        assert plan.chunks_per_part >= mk.MIN_PARTITION_CHUNKS
    else:
        assert plan.parts == [1] * len(seq_lens)
    assert max(plan.parts) <= mk.MAX_PARTITIONS
    for b, ctx in enumerate(seq_lens):
        ranges = plan.token_ranges(b, ctx)
        covered = [t for s, e in ranges for t in range(s, e)]
        assert covered == list(range(ctx))
        assert all(e > s for s, e in ranges) or ctx == 0
        assert all(s % 16 == 0 for s, _ in ranges)
        sizes = [e - s for s, e in ranges]
        assert all(x == sizes[0] for x in sizes[:-1]) and sizes[-1] <= sizes[0], "equal partitions but the last"
        assert plan.lens[b] <= plan.chunks_per_part


def test_partition_plan_examples():
    assert mk.partition_plan([128], 8, 132).items == 8                 # one chunk per warp, no merge
    long = mk.partition_plan([2048], 8, 132)
    assert long.parts == [15] and long.items == 120                     # nearly one item per SM
    assert long.lens == [9]                                             # 14 x 144 tokens + 32
    assert mk.partition_plan([512] * 8, 8, 132).lens == [16] * 8        # 2 x 256, not 496 + 16
    assert mk.partition_plan([2048] * 16, 8, 132).parts == [1] * 16     # 128 items: no split needed


def test_smem_plan_of_qwen3_0_6b_on_an_h200():
    plan = mk.smem_plan(1024, 3072, 16, 8, 128, 132)
    # w0: 3 gate/up granule pairs of 1024 columns; w1: one down granule of 3072; uni: the 64 KB attention ring.
    assert plan["w0"] == 3 * 16 * 1024 * 2 and plan["w1"] == 8 * 3072 * 2 and plan["uni"] == 65536
    assert plan["misc"] == 768 and plan["nw"] == 2048 and plan["total"] == 220672 <= mk.DEFAULT_SMEM_LIMIT
    assert mk.unsupported_reason(_arch("qwen3-0.6b"), torch.bfloat16, 16, 16) is None


def test_unsupported_shapes_name_the_reason():
    a = _arch("qwen3-0.6b")
    reason = mk.unsupported_reason
    assert "sm_90" in reason(a, torch.bfloat16, 16, 1, capability=(8, 0))
    assert "dtype" in reason(a, torch.float32, 16, 1)
    assert "decode rows" in reason(a, torch.bfloat16, 16, 17)
    assert "block_size" in reason(a, torch.bfloat16, 8, 1)
    assert "granules" in reason(_arch("qwen2.5-0.5b"), torch.bfloat16, 16, 1)
    assert "shared memory" in reason(a, torch.bfloat16, 16, 1, smem_limit=200_000)
    assert not mk.applies(a, torch.bfloat16, 16, 1, torch.device("cpu"))
    assert mk.applies(a, torch.bfloat16, 32, 16)


def test_wrapper_needs_a_gpu():
    from minillm.attention.torch_backend import TorchAttentionBackend
    from minillm.model.qwen3 import QwenForCausalLM

    model = QwenForCausalLM(_tiny_arch(), TorchAttentionBackend())
    with pytest.raises(ValueError, match="CUDA"):
        mk.DecodeMegakernel(model, [], 1, 16, 64)


def _tiny_arch(**kw) -> ModelArchConfig:
    d = dict(architectures=["Qwen3ForCausalLM"], vocab_size=64, hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=128, tie_word_embeddings=True)
    d.update(kw)
    return ModelArchConfig.from_hf_dict(d)


def test_reference_is_the_torch_path_and_restores_the_model():
    """reference_decode_step equals the model run on the torch backend, and leaves the model's backend as it was."""
    from minillm.attention.metadata import AttentionMetadata
    from minillm.attention.torch_backend import TorchAttentionBackend
    from minillm.model.loader import init_dummy_weights
    from minillm.model.qwen3 import QwenForCausalLM

    class Marker(TorchAttentionBackend):
        pass

    marker = Marker()
    model = QwenForCausalLM(_tiny_arch(), marker)
    init_dummy_weights(model, seed=3)
    a = model.arch
    caches = [(torch.randn(4, 16, a.num_key_value_heads, a.head_dim), torch.randn(4, 16, a.num_key_value_heads,
                                                                                    a.head_dim)) for _ in range(2)]
    ids, pos = torch.tensor([3, 5]), torch.tensor([20, 2])
    meta = AttentionMetadata(num_seqs=2, num_decodes=2, num_tokens=2, max_query_len=1, max_seq_len=21,
                             slot_mapping=torch.tensor([20, 16 * 2 + 2]), query_start_loc=torch.tensor([0, 1, 2]),
                             seq_lens=torch.tensor([21, 3], dtype=torch.int32),
                             block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), block_size=16,
                             query_start_loc_cpu=[0, 1, 2], seq_lens_cpu=[21, 3])
    ref_caches = [(k.clone(), v.clone()) for k, v in caches]
    out = mk.reference_decode_step(model, ids, pos, ref_caches, meta)
    assert all(layer.self_attn.attn_backend is marker for layer in model.model.layers)
    expect = model(ids, pos, caches, meta)
    assert torch.equal(out, expect)
    assert all(torch.equal(x, y) for kv, rkv in zip(caches, ref_caches) for x, y in zip(kv, rkv))


def test_step_bytes_of_qwen3_0_6b():
    a = _arch("qwen3-0.6b")
    b = mk.step_bytes(a, [128])
    assert abs(b["weight_bytes"] / 28 / 2**20 - 30.0) < 0.1      # ~30 MiB of weights per layer
    assert b["kv_bytes"] == 128 * 28 * 2 * 8 * 128 * 2


def _cpu_case(pad=2):
    from minillm.diagnostics import megakernel_check as chk

    arch = chk.tiny_arch("qwen3", hidden=64, inter=128, heads=4, kv_heads=2, head_dim=16, max_pos=512)
    model = chk.random_model(arch, torch.float32, "cpu", seed=1)
    return chk, model, chk.make_decode_case(arch, [1, 17, 40], pad, 16, torch.float32, "cpu", seed=2)


def test_check_harness_accepts_the_reference_itself():
    """The GPU comparison run with the torch path in the kernel's place: passes, and padded rows are NaN."""
    from minillm.ops.megakernel import reference_decode_step

    chk, model, case = _cpu_case()
    res = chk.compare(model, case, 16, runner=lambda m, caches, c: reference_decode_step(
        m, c.input_ids, c.positions, caches, c.meta))
    assert res["passed"] and res["hidden_rel_err"] == 0 and res["untouched_slots_equal"], res
    ref = reference_decode_step(model, case.input_ids, case.positions, [(k.clone(), v.clone()) for k, v in case.caches],
                                case.meta)
    assert torch.isfinite(ref[:3]).all() and torch.isnan(ref[3:]).all(), "padded rows read a never-written slot"


def test_check_harness_catches_a_stray_write_and_a_wrong_output():
    from minillm.ops.megakernel import reference_decode_step

    chk, model, case = _cpu_case()

    def stray(m, caches, c):
        out = reference_decode_step(m, c.input_ids, c.positions, caches, c.meta)
        caches[1][0].view(-1)[-1] = 0.0   # a slot nobody owns
        return out

    def off(m, caches, c):
        return reference_decode_step(m, c.input_ids, c.positions, caches, c.meta) * 1.01

    assert not chk.compare(model, case, 16, runner=stray)["untouched_slots_equal"]
    res = chk.compare(model, case, 16, runner=off)
    assert not res["passed"] and res["hidden_rel_err"] > 5e-3


def test_partition_plan_random_batches():
    """Many random batches: every partition non-empty, coverage exact, items within the grid when it can be."""
    import random

    rng = random.Random(0)
    for _ in range(2000):
        b, hkv, ctas = rng.randint(1, 16), rng.choice([1, 2, 4, 8]), rng.choice([16, 78, 114, 132])
        lens = [rng.choice([1, rng.randint(1, 64), rng.randint(1, 9000)]) for _ in range(b)]
        plan = mk.partition_plan(lens, hkv, ctas, min_chunks=rng.choice([1, 4, 8]))
        if ctas > hkv * b:
            assert plan.items <= ctas
        for s, ctx in enumerate(lens):
            ranges = plan.token_ranges(s, ctx)
            assert all(e > st for st, e in ranges) and ranges[0][0] == 0 and ranges[-1][1] == ctx
            assert all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))


def test_check_harness_catches_a_nan_row():
    from minillm.ops.megakernel import reference_decode_step

    chk, model, case = _cpu_case(pad=0)

    def nan_row(m, caches, c):
        out = reference_decode_step(m, c.input_ids, c.positions, caches, c.meta).clone()
        out[1, 3] = float("nan")
        return out

    res = chk.compare(model, case, 16, runner=nan_row)
    assert res["hidden_rel_err"] == float("inf") and not res["passed"]


def _bindings_schema():
    import re

    src = (CUDA_DIR / "megakernel_bindings.cpp").read_text()
    body = re.search(r'm\.def\((.*?)\);', src, re.S).group(1)
    return torch._C.parse_schema("".join(re.findall(r'"(.*?)"', body)))


def test_wrapper_call_matches_the_op_schema(monkeypatch):
    """DecodeMegakernel.forward's call, checked against the schema in megakernel_bindings.cpp and the sizes the
    binding demands (on the CPU: the wrapper is assembled by hand, the op replaced by this check)."""
    from minillm.attention.metadata import AttentionMetadata
    from minillm.attention.torch_backend import TorchAttentionBackend
    from minillm.model.loader import init_dummy_weights
    from minillm.model.qwen3 import QwenForCausalLM

    for arch in (_tiny_arch(), _tiny_arch(architectures=["Qwen2ForCausalLM"], hidden_size=64, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=None)):
        model = QwenForCausalLM(arch, TorchAttentionBackend(), dtype=torch.bfloat16)
        init_dummy_weights(model)
        caches = [(torch.zeros(4, 16, arch.num_key_value_heads, arch.head_dim, dtype=torch.bfloat16),) * 2
                  for _ in range(arch.num_hidden_layers)]
        wrapper = mk.DecodeMegakernel.__new__(mk.DecodeMegakernel)
        wrapper.arch, wrapper.max_batch, wrapper.block_size = arch, 4, 16
        wrapper.device, wrapper.dtype, wrapper.limits = torch.device("cpu"), torch.bfloat16, {"num_ctas": 132}
        wrapper.min_partition_chunks, wrapper.cooperative = 8, True
        wrapper._caches = [c for kv in caches for c in kv]
        wrapper._pack(model)
        wrapper._alloc_workspaces()
        schema = _bindings_schema()
        seen = {}

        def fake_op(*args):
            assert len(args) == len(schema.arguments)
            for a, v in zip(schema.arguments, args):
                t = str(a.type)
                if t == "Tensor":
                    assert isinstance(v, torch.Tensor), a.name
                elif t == "Optional[Tensor]":
                    assert v is None or isinstance(v, torch.Tensor), a.name
                elif t == "List[Tensor]":
                    assert isinstance(v, list) and all(isinstance(x, torch.Tensor) for x in v), a.name
                else:
                    assert isinstance(v, {"int": int, "float": float, "bool": bool}[t]), (a.name, t, v)
                seen[a.name] = v

        monkeypatch.setattr(torch.ops.minillm, "decode_megakernel", fake_op, raising=False)
        meta = AttentionMetadata(num_seqs=3, num_decodes=3, num_tokens=3, max_query_len=1, max_seq_len=9,
                                 slot_mapping=torch.tensor([1, 2, -1]), query_start_loc=torch.arange(4),
                                 seq_lens=torch.tensor([2, 3, 9], dtype=torch.int32),
                                 block_tables=torch.zeros(3, 2, dtype=torch.int32), block_size=16)
        out = wrapper.forward(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 8]), meta)
        assert out.shape == (3, arch.hidden_size)
        # What megakernel_bindings.cpp checks: dtypes and minimum sizes.
        h, i, d, layers = arch.hidden_size, arch.intermediate_size, arch.head_dim, arch.num_hidden_layers
        hq, hkv = arch.num_attention_heads, arch.num_key_value_heads
        nqkv, kq = (hq + 2 * hkv) * d, hq * d
        assert seen["input_ids"].dtype == seen["positions"].dtype == seen["slot_mapping"].dtype == torch.int64
        assert seen["seq_lens"].dtype == seen["block_tables"].dtype == torch.int32
        assert len(seen["kv_caches"]) == 2 * layers
        assert seen["w_qkv"].numel() >= layers * nqkv * h and seen["w_o"].numel() >= layers * h * kq
        assert seen["w_gu"].numel() >= layers * 2 * i * h and seen["w_down"].numel() >= layers * h * i
        assert (seen["b_qkv"] is None) == (not arch.qkv_bias) and (seen["q_norm"] is None) == (not arch.qk_norm)
        assert seen["ln1"].numel() >= layers * h and seen["final_norm"].numel() == h
        assert seen["cos_sin"].dtype == torch.float32 and seen["cos_sin"].shape[1] == d
        assert seen["act_ws"].numel() >= 16 * (nqkv + kq + i + h) and seen["act_ws"].dtype == torch.bfloat16
        assert seen["partials"].dtype == torch.float32 and seen["partials"].numel() >= 132 * (hq // hkv) * (d + 2)
        assert seen["sync"].dtype == torch.int32 and seen["sync"].numel() >= 4 + 16 * hkv
        assert seen["out"].shape == (16, h)
        assert (seen["num_heads"], seen["num_kv_heads"], seen["head_dim"], seen["intermediate"]) == (hq, hkv, d, i)
        assert seen["scale"] == d ** -0.5 and seen["num_ctas"] == 132
        assert seen["profile"] is None
        assert all(t.is_contiguous() for n, t in seen.items() if isinstance(t, torch.Tensor) and n not in
                   ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables"))


@pytest.mark.slow
def test_binding_signature_matches_its_schema(tmp_path):
    """The C++ signatures of decode_megakernel and its Meta twin, registered under the schema of the bindings
    file in a CPU-only extension (the real file needs CUDA headers): torch refuses a mismatch when the library
    loads, which on the GPU would take every minillm op down with it. Runs in a subprocess: a mismatch aborts."""
    import re
    import shutil
    import subprocess
    import sys

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    src = (CUDA_DIR / "megakernel_bindings.cpp").read_text()
    sig = re.search(r"void decode_megakernel\((.*?)\) \{", src, re.S).group(1)
    meta = re.search(r"void decode_megakernel_meta\((.*?)\) \{\}", src, re.S).group(1)
    schema = "".join(re.findall(r'"(.*?)"', re.search(r"m\.def\((.*?)\);", src, re.S).group(1)))
    (tmp_path / "sig.cpp").write_text(
        "#include <ATen/ATen.h>\n#include <torch/library.h>\nusing at::Tensor;\n"
        f"void decode_megakernel({sig}) {{}}\nvoid decode_megakernel_meta({meta}) {{}}\n"
        f'TORCH_LIBRARY(minillm_sig_probe, m) {{\n  m.def("{schema}");\n'
        '  m.impl("decode_megakernel", c10::DispatchKey::CPU, TORCH_FN(decode_megakernel));\n'
        '  m.impl("decode_megakernel", c10::DispatchKey::Meta, TORCH_FN(decode_megakernel_meta));\n}\n')
    code = (f"from torch.utils.cpp_extension import load\n"
            f"load(name='minillm_sig_probe', sources=[{str(tmp_path / 'sig.cpp')!r}], build_directory={str(tmp_path)!r},"
            f" is_python_module=False)\nimport torch\nprint(torch.ops.minillm_sig_probe.decode_megakernel.default._schema)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Tensor(a!)[] kv_caches" in run.stdout


def test_phase_reference_is_the_model_path_and_fragments_unpack():
    """The step-by-step torch twin used by the GPU phase test computes what the model computes (one layer, fp32),
    and A-fragment buffers unpack to what was packed."""
    import dataclasses

    from minillm.diagnostics import megakernel_check as chk
    from minillm.ops.megakernel import reference_decode_step

    arch = dataclasses.replace(chk.tiny_arch("qwen2", hidden=64, inter=128, heads=4, kv_heads=2, head_dim=16,
                                             max_pos=512), num_hidden_layers=1)
    model = chk.random_model(arch, torch.float32, "cpu", seed=4)
    case = chk.make_decode_case(arch, [1, 17, 40], 0, 16, torch.float32, "cpu", seed=5)
    phases = chk.phase_reference(model, case)
    full = reference_decode_step(model, case.input_ids, case.positions, chk._clone(case.caches), case.meta)
    torch.testing.assert_close(phases["out"], full, rtol=1e-5, atol=1e-5)
    x = torch.randn(5, 96)
    assert torch.equal(chk.unpack_act_fragments(mk.pack_act_fragments(x), 5, 96), x)

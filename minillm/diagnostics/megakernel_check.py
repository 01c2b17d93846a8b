"""The decode megakernel against its torch twin, on NaN-poisoned caches: the `check-kernels` rows and the cases
tests/test_megakernel_gpu.py asserts on.

A case is a random model (tiny Qwen3 / Qwen2 shapes or the Qwen3-0.6B shape), a decode step over ragged contexts
with random block tables, NaN in every cache slot nobody owns, and optionally padded rows (slot -1, as CUDA-graph
padding). The megakernel and reference_decode_step (the model's pure-torch path) each run on their own copy of the
caches. Compared: the hidden states of the real rows (relative L2 error per row), the new k/v slots (relative
error), every other cache slot (bit for bit against the untouched copy: NaN must stay NaN), and a CUDA-graph replay
of the same step from the same caches (bit for bit against the eager launch: the kernel is deterministic).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Relative L2 error of a hidden row / of the new K/V rows. The kernel sums the GEMVs in another order than cuBLAS,
# so a bf16 intermediate moves by an ulp here and there; over 28 layers that stays around 1e-2. A wrong rounding
# point or a wrong element is O(1).
TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-4}


def tiny_arch(arch: str = "qwen3", *, hidden=256, inter=512, heads=4, kv_heads=2, head_dim=64, layers=2,
              vocab=512, max_pos=16384):
    from minillm.model.arch import ModelArchConfig

    d = dict(architectures=["Qwen3ForCausalLM" if arch == "qwen3" else "Qwen2ForCausalLM"], vocab_size=vocab,
             hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
             num_key_value_heads=kv_heads, max_position_embeddings=max_pos, tie_word_embeddings=True,
             rope_theta=1e6, rms_norm_eps=1e-6)
    if arch == "qwen3":
        d["head_dim"] = head_dim
    elif hidden != heads * head_dim:
        raise ValueError("qwen2 derives head_dim from hidden / heads")
    return ModelArchConfig.from_hf_dict(d)


def qwen3_0_6b_arch():
    import json
    from pathlib import Path

    from minillm.model.arch import ModelArchConfig

    preset = Path(__file__).resolve().parents[1] / "presets" / "qwen3-0.6b.json"
    return ModelArchConfig.from_hf_dict(json.loads(preset.read_text()))


@torch.no_grad()
def random_model(arch, dtype=torch.bfloat16, device="cuda", seed=0):
    """A model with random weights whose activations stay O(1) through the layers: matrices N(0, 0.7 / sqrt(fan_in)),
    norm weights 1 + N(0, 0.1), biases N(0, 0.1), embedding N(0, 1)."""
    from minillm.attention.torch_backend import TorchAttentionBackend
    from minillm.model.qwen3 import QwenForCausalLM

    model = QwenForCausalLM(arch, TorchAttentionBackend(), dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen, device=device))
        elif name.endswith("bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen, device=device))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen, device=device))
        else:
            p.copy_(torch.randn(p.shape, generator=gen, device=device) * (0.7 / math.sqrt(p.shape[-1])))
    return model.eval()


@dataclass
class DecodeCase:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: object
    caches: list             # per layer (k, v): the step's starting state (NaN where no token lives)
    real_rows: list[int]
    new_slots: torch.Tensor  # flat slots written this step (real rows)


def make_decode_case(arch, ctx_lens: list[int], num_pad: int = 0, block_size: int = 16, dtype=torch.bfloat16,
                     device="cuda", seed: int = 0) -> DecodeCase:
    """Rows 0..len(ctx_lens)-1 are real sequences with ctx_lens[b] tokens including the new one; num_pad padded
    rows follow (slot -1, a few tokens of context whose last slot was never written: NaN)."""
    from minillm.attention.metadata import AttentionMetadata

    gen = torch.Generator().manual_seed(seed)
    pad_lens = [int(x) for x in torch.randint(1, 40, (num_pad,), generator=gen)]
    lens = list(ctx_lens) + pad_lens
    blocks = [-(-c // block_size) for c in lens]
    num_blocks = sum(blocks) + 5
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(blocks)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    cur = 0
    for b, nb in enumerate(blocks):
        tables[b, :nb] = perm[cur:cur + nb].to(torch.int32)
        cur += nb
    hkv, d = arch.num_key_value_heads, arch.head_dim
    flat_slots = []
    for b, c in enumerate(lens):
        pos = torch.arange(c)
        flat_slots.append(tables[b, pos // block_size].long() * block_size + pos % block_size)
    # Every token before the new one is in the cache; everything else is NaN. Filled on the device (the 0.6B
    # shape at 8k tokens is ~1e9 values).
    old = torch.cat([s[:-1] for s in flat_slots]).to(device)
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    caches = []
    for _ in range(arch.num_hidden_layers):
        kv = []
        for _ in range(2):
            cache = torch.full((num_blocks * block_size, hkv, d), float("nan"), dtype=dtype, device=device)
            cache[old] = torch.randn(len(old), hkv, d, generator=dev_gen, device=device).to(dtype)
            kv.append(cache.view(num_blocks, block_size, hkv, d))
        caches.append(tuple(kv))
    real = list(range(len(ctx_lens)))
    slots = torch.tensor([s[-1].item() for s in flat_slots[:len(ctx_lens)]] + [-1] * num_pad, dtype=torch.int64)
    ids = torch.randint(0, arch.vocab_size, (len(lens),), generator=gen)
    positions = torch.tensor([c - 1 for c in lens], dtype=torch.int64)
    n = len(lens)
    meta = AttentionMetadata(num_seqs=n, num_decodes=n, num_tokens=n, max_query_len=1, max_seq_len=max(lens),
                             slot_mapping=slots.to(device), query_start_loc=torch.arange(n + 1, dtype=torch.int32,
                                                                                         device=device),
                             seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
                             block_tables=tables.to(device), block_size=block_size,
                             query_start_loc_cpu=list(range(n + 1)), seq_lens_cpu=lens)
    return DecodeCase(ids.to(device), positions.to(device), meta, caches, real, slots[:len(ctx_lens)].to(device))


def _clone(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


def _restore(dst, src) -> None:
    for (dk, dv), (sk, sv) in zip(dst, src):
        dk.copy_(sk)
        dv.copy_(sv)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error; inf when either side has a non-finite value (inf survives max(), NaN would not)."""
    a, b = a.float(), b.float()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-6))


@torch.no_grad()
def compare(model, case: DecodeCase, block_size: int, graph: bool = True, runner=None) -> dict:
    """Run the megakernel and the reference on the case; the error figures described at the top.

    runner(model, caches, case) -> hidden replaces the megakernel (the CPU tests pass broken runners to show that
    these checks fail); the graph replay is then skipped."""
    from minillm.ops.megakernel import DecodeMegakernel, reference_decode_step

    ref_caches = _clone(case.caches)
    ref = reference_decode_step(model, case.input_ids, case.positions, ref_caches, case.meta)
    mk_caches = _clone(case.caches)
    n = case.input_ids.shape[0]
    if runner is None:
        mk = DecodeMegakernel(model, mk_caches, max_batch=n, block_size=block_size,
                              max_model_len=model.cos_sin_cache.shape[0])
        out = mk.forward(case.input_ids, case.positions, case.meta).clone()
        torch.cuda.synchronize()
    else:
        out, graph = runner(model, mk_caches, case), False
    rows = case.real_rows
    res = dict(hidden_rel_err=max(_rel(out[r], ref[r]) for r in rows))
    kv_err, untouched = 0.0, True
    for (mk_k, mk_v), (rk, rv), (ok, ov) in zip(mk_caches, ref_caches, case.caches):
        for got, want, orig in ((mk_k, rk, ok), (mk_v, rv, ov)):
            flat_got, flat_want = got.view(-1, *got.shape[2:]), want.view(-1, *want.shape[2:])
            kv_err = max(kv_err, _rel(flat_got[case.new_slots], flat_want[case.new_slots]))
            keep = torch.ones(flat_got.shape[0], dtype=torch.bool, device=got.device)
            keep[case.new_slots] = False
            untouched &= torch.equal(_bits(flat_got[keep]), _bits(orig.view_as(flat_got)[keep]))
    res.update(new_kv_rel_err=kv_err, untouched_slots_equal=bool(untouched))
    if graph:
        after = _clone(mk_caches)
        _restore(mk_caches, case.caches)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            mk.forward(case.input_ids, case.positions, case.meta)
        g.replay()
        same = torch.equal(_bits(mk.out[:n]), _bits(out))
        same &= all(torch.equal(_bits(a), _bits(b)) for kv, kv2 in zip(mk_caches, after) for a, b in zip(kv, kv2))
        res["graph_replay_equal"] = bool(same)
    res["tol"] = TOL.get(out.dtype, 1e-4)
    res["passed"] = (res["hidden_rel_err"] <= res["tol"] and res["new_kv_rel_err"] <= res["tol"]
                     and res["untouched_slots_equal"] and res.get("graph_replay_equal", True))
    return res


def check_cases(quick: bool = False):
    """(label, arch, dtype, block_size, ctx_lens, num_pad) of the check-kernels sweep."""
    shapes = [
        ("qwen3 D64 H4/2", tiny_arch("qwen3"), torch.bfloat16, 16),
        ("qwen3 D128 H8/2", tiny_arch("qwen3", hidden=512, inter=1024, heads=8, kv_heads=2, head_dim=128),
         torch.bfloat16, 32),
        ("qwen2 D64 H8/1 bias", tiny_arch("qwen2", hidden=512, inter=1024, heads=8, kv_heads=1), torch.bfloat16, 16),
        ("qwen3 D64 H16/1 fp16", tiny_arch("qwen3", heads=16, kv_heads=1, inter=256), torch.float16, 32),
    ]
    batches = [("B1 ctx1", [1], 0), ("B3 ragged", [17, 300, 4100], 0), ("B8 block edges", [15, 16, 17, 31, 32, 33, 64, 65], 0),
               ("B16 mixed+pad", [1, 2, 5, 16, 17, 100, 127, 128, 129, 255, 256, 257, 511, 2049], 2)]
    if quick:
        batches = batches[1:3]
    for label, arch, dtype, bs in shapes:
        for blabel, ctx, pad in batches:
            yield f"megakernel {label} bs{bs} {blabel}", arch, dtype, bs, ctx, pad


def run_megakernel_cases(quick: bool = False) -> list[dict]:
    """check-kernels rows: {case, max_abs_err, tol, passed, ...}; max_abs_err holds the worst *relative* error of
    the hidden rows and the new K/V (inf when a cache slot or the graph replay differs), so the rows print like
    the other kernels' checks. No rows on a GPU older than sm_90."""
    from minillm.ops.build import load_extension

    if torch.cuda.get_device_capability()[0] < 9:
        return []   # the megakernel needs sm_90; nothing to check here
    load_extension()
    rows, models = [], {}
    for seed, (label, arch, dtype, bs, ctx, pad) in enumerate(check_cases(quick)):
        key = (arch, dtype)
        if key not in models:
            models[key] = random_model(arch, dtype, seed=len(models))
        case = make_decode_case(arch, ctx, pad, bs, dtype, seed=seed)
        res = compare(models[key], case, bs)
        err = max(res["hidden_rel_err"], res["new_kv_rel_err"])
        if not (res["untouched_slots_equal"] and res.get("graph_replay_equal", True)):
            err = float("inf")
        rows.append({"case": label, **res, "max_abs_err": err})
    return rows


def unpack_act_fragments(buf: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """[rows, k] from a flat 16-row row-fragment buffer (inverse of megakernel.pack_act_fragments)."""
    from minillm.ops.megakernel import act_fragment_index

    m = torch.arange(rows, device=buf.device)[:, None].expand(rows, k)
    kk = torch.arange(k, device=buf.device)[None, :].expand(rows, k)
    return buf[act_fragment_index(m, kk, k)]


@torch.no_grad()
def phase_reference(model, case: DecodeCase) -> dict:
    """The torch path of a one-layer model, phase by phase (fused_ops' torch code, F.linear, the fp32 paged
    attention reference): qkv [B, Nqkv], attn [B, Hq D], swiglu [B, I], resid [B, H] (after down), out [B, H]."""
    import torch.nn.functional as F

    from minillm.ops import fused_ops
    from minillm.ops.reference import kv_write_ref, paged_attention_ref

    a = model.arch
    if a.num_hidden_layers != 1:
        raise ValueError("the phase-by-phase check needs a one-layer model")
    layer, n, d = model.model.layers[0], case.input_ids.shape[0], a.head_dim
    # fused_ops.* with cuda=False (the default) is the torch path
    sa, mlp, eps = layer.self_attn, layer.mlp, a.rms_norm_eps
    x0 = F.embedding(case.input_ids, model.model.embed_tokens.weight)
    qkv = F.linear(fused_ops.rms_norm(x0, layer.input_layernorm.weight, eps), sa.qkv_proj.weight, sa.qkv_proj.bias)
    q, k, v = fused_ops.qk_norm_rope(qkv, case.positions, model.cos_sin_cache, a.num_attention_heads,
                                     a.num_key_value_heads, d, sa.q_norm.weight if sa.q_norm else None,
                                     sa.k_norm.weight if sa.k_norm else None, eps)
    caches = _clone(case.caches)
    kv_write_ref(k, v, caches[0][0], caches[0][1], case.meta.slot_mapping)
    attn = paged_attention_ref(q, caches[0][0], caches[0][1], case.meta.block_tables, case.meta.seq_lens_cpu,
                               list(range(n + 1)), d ** -0.5).to(q.dtype).reshape(n, a.q_size)
    resid1 = F.linear(attn, sa.o_proj.weight) + x0
    normed2 = fused_ops.rms_norm(resid1, layer.post_attention_layernorm.weight, eps)
    swiglu = fused_ops.silu_and_mul(F.linear(normed2, mlp.gate_up_proj.weight))
    resid2 = F.linear(swiglu, mlp.down_proj.weight) + resid1
    final = fused_ops.rms_norm(resid2, model.model.norm.weight, eps)
    return dict(qkv=qkv, attn=attn, swiglu=swiglu, resid=resid2, out=final)


@torch.no_grad()
def phase_errors(model, case: DecodeCase, block_size: int) -> dict:
    """For a one-layer model: the relative error of each phase's output as the kernel leaves it in its workspaces
    (qkv, attention output, SwiGLU output, residual stream, final hidden) against phase_reference. Tells which
    phase is wrong when the end-to-end check fails. Real rows only."""
    from minillm.ops.megakernel import DecodeMegakernel

    a, n = model.arch, case.input_ids.shape[0]
    h, i = a.hidden_size, a.intermediate_size
    nqkv, kq = a.q_size + 2 * a.kv_size, a.q_size
    want = phase_reference(model, case)
    mk = DecodeMegakernel(model, _clone(case.caches), max_batch=n, block_size=block_size,
                          max_model_len=model.cos_sin_cache.shape[0])
    out = mk.forward(case.input_ids, case.positions, case.meta).clone()
    ws = mk.act_ws
    got = dict(qkv=ws[:16 * nqkv].view(16, nqkv)[:n],
               attn=unpack_act_fragments(ws[16 * nqkv:16 * (nqkv + kq)], n, kq),
               swiglu=unpack_act_fragments(ws[16 * (nqkv + kq):16 * (nqkv + kq + i)], n, i),
               resid=ws[16 * (nqkv + kq + i):16 * (nqkv + kq + i + h)].view(16, h)[:n], out=out)
    return {name: max(_rel(got[name][r], want[name][r]) for r in case.real_rows) for name in want}

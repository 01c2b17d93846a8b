"""Qwen3-MoE end to end: the engine's greedy tokens equal HF transformers' Qwen3MoeForCausalLM (fp32, CPU) on tiny
random checkpoints (expert counts 4-16, top-1 to top-4, norm_topk_prob on and off, dense layers by mlp_only_layers
and decoder_sparse_step, both checkpoint layouts, both expert paths), across chunked prefill, prefix hits and preemption."""
import random

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.config import ConfigError
from minillm.model.layers import MLP
from minillm.model.loader import load_model
from minillm.model.qwen3_moe import SparseMoeBlock
from tiny_models import make_tiny_moe_checkpoint

MAX_LEN = 128
GREEDY = dict(temperature=0.0, ignore_eos=True)
SHAPES = {   # name: keyword arguments of make_tiny_moe_checkpoint
    "e8-top2-norm-dense1": dict(experts=8, top_k=2, norm_topk_prob=True, mlp_only_layers=[1], seed=1),
    # moe_intermediate 30: 120-byte rows, so these experts take the loop path instead of grouped_mm
    "e4-top1-loop": dict(experts=4, top_k=1, norm_topk_prob=False, moe_intermediate=30, seed=2),
    "e16-top4-step2-fused": dict(experts=16, top_k=4, norm_topk_prob=False, decoder_sparse_step=2, layers=4,
                                 fused=True, tie=True, seed=3),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {name: make_tiny_moe_checkpoint(tmp_path_factory.mktemp(name), **kw) for name, kw in SHAPES.items()}


@pytest.fixture(scope="module")
def hf_cache():
    return {}


def reference(path, prompt, n, cache):
    """HF greedy with its eager experts (the per-expert loop of modeling_qwen3_moe, not its grouped_mm kernel
    path, which also refuses rows that are not multiples of 16 bytes)."""
    from transformers import AutoModelForCausalLM
    key = (str(path), tuple(prompt), n)
    if key not in cache:
        model = cache.get(str(path)) or cache.setdefault(str(path), AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, experts_implementation="eager").eval())
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=0)
        cache[key] = out[0, len(prompt):].tolist()
    return cache[key]


def prompts(seed, lens=(1, 17, 33, 48)):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lens]


def run(path, ps, max_tokens=8, **kw):
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=MAX_LEN, check_integrity=True, **kw)
    outs = llm.generate(ps, SamplingParams(max_tokens=max_tokens, **GREEDY), use_tqdm=False)
    return llm, [o.token_ids for o in outs]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_greedy_equals_hf(shape, ckpts, hf_cache):
    ps = prompts(len(shape))
    llm, got = run(ckpts[shape], ps)
    blocks = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all((m.host_sync_reason is None) == ("loop" not in shape) for m in blocks)
    for p, g in zip(ps, got):
        assert g == reference(ckpts[shape], p, 8, hf_cache)


def test_layers_and_routing_spread(ckpts):
    kw = SHAPES["e8-top2-norm-dense1"]
    model, arch, _ = load_model(str(ckpts["e8-top2-norm-dense1"]), dtype="float32", device="cpu")
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert kinds == [SparseMoeBlock, MLP, SparseMoeBlock] and arch.moe_layers == (0, 2)
    sparse = load_model(str(ckpts["e16-top4-step2-fused"]), dtype="float32", device="cpu")[1]
    assert sparse.moe_layers == (1, 3)   # decoder_sparse_step 2: layers 1 and 3
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(ckpts["e8-top2-norm-dense1"], dtype=torch.float32)
    assert arch.num_params == sum(p.numel() for p in hf.parameters())
    # the sharpened router still spreads a prompt over every expert of each MoE layer
    used = {}
    hooks = [layer.mlp.register_forward_hook(lambda m, i, o, li=li: used.setdefault(li, set()).update(
        torch.topk(torch.nn.functional.linear(i[0], m.gate.weight), kw["top_k"]).indices.flatten().tolist()))
        for li, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoeBlock)]
    llm_prompt = prompts(9, (60,))[0]
    from tiny_models import alloc_block_tables, build_metadata, flat_positions
    tables, nblocks = alloc_block_tables([60], 16)
    caches = [(torch.zeros(nblocks, 16, 2, 16), torch.zeros(nblocks, 16, 2, 16)) for _ in range(3)]
    with torch.no_grad():
        model(torch.tensor(llm_prompt), flat_positions([(0, 60)]), caches, build_metadata([(0, 60)], 16, tables))
    for h in hooks:
        h.remove()
    assert all(len(s) == 8 for s in used.values()) and len(used) == 2


def test_chunked_prefill_equals_hf(ckpts, hf_cache):
    path = ckpts["e8-top2-norm-dense1"]
    ps = prompts(20)
    _, got = run(path, ps, max_num_batched_tokens=8)
    for p, g in zip(ps, got):
        assert g == reference(path, p, 8, hf_cache)


def test_prefix_hits_equal_hf(ckpts, hf_cache):
    path = ckpts["e16-top4-step2-fused"]
    rng = random.Random(21)
    shared = [rng.randrange(256) for _ in range(40)]
    ps = [shared + [rng.randrange(256) for _ in range(k)] for k in (0, 5, 11)]
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=MAX_LEN, check_integrity=True)
    sp = SamplingParams(max_tokens=8, **GREEDY)
    first = llm.generate([ps[0]], sp, use_tqdm=False)[0]
    rest = llm.generate(ps[1:], sp, use_tqdm=False)
    assert [o.num_cached_tokens for o in rest] == [32, 32]
    for p, o in zip(ps, [first, *rest]):
        assert o.token_ids == reference(path, p, 8, hf_cache)


def test_preemption_equals_hf(ckpts, hf_cache):
    path = ckpts["e4-top1-loop"]
    ps = prompts(22)
    llm, got = run(path, ps, max_tokens=16, num_kv_blocks=8, max_num_batched_tokens=32)
    assert llm.num_preemptions > 0
    for p, g in zip(ps, got):
        assert g == reference(path, p, 16, hf_cache)


def test_missing_expert_tensor_is_named(ckpts, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    src = ckpts["e4-top1-loop"]
    shutil.copy(src / "config.json", tmp_path / "config.json")
    state = load_file(str(src / "model.safetensors"))
    del state["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"missing tensors \['model.layers.1.mlp.experts.3.up_proj.weight'\]"):
        load_model(str(tmp_path), dtype="float32", device="cpu")


def test_both_layouts_load_the_same_weights(ckpts, tmp_path):
    """The hub layout (one tensor per expert) and the fused 3-D layout fill the stacked parameters identically."""
    from safetensors.torch import save_file
    hub = ckpts["e8-top2-norm-dense1"]
    a = load_model(str(hub), dtype="float32", device="cpu")[0]
    from transformers import AutoModelForCausalLM
    state = {k: v.contiguous() for k, v in AutoModelForCausalLM.from_pretrained(hub).state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    import shutil
    shutil.copy(hub / "config.json", tmp_path / "config.json")
    save_file(state, str(tmp_path / "model.safetensors"))
    b = load_model(str(tmp_path), dtype="float32", device="cpu")[0]
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    gu = a.model.layers[0].mlp.experts.gate_up_proj
    assert torch.equal(gu, state["model.layers.0.mlp.experts.gate_up_proj"])


def test_moe_config_errors_name_the_key():
    base = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2}
    from minillm.model.arch import ModelArchConfig
    assert ModelArchConfig.from_hf_dict(base).moe_layers == (0, 1)
    for bad, words in [({"num_experts_per_tok": 5}, "num_experts_per_tok=5"), ({"num_experts": 0}, "num_experts=0"),
                       ({"mlp_only_layers": [2]}, "mlp_only_layers=[2]"), ({"moe_intermediate_size": None},
                                                                           "moe_intermediate_size"),
                       ({"decoder_sparse_step": 0}, "decoder_sparse_step=0")]:
        with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
            ModelArchConfig.from_hf_dict({**base, **bad})


def test_30b_a3b_preset_builds_on_meta_device():
    from minillm.attention.torch_backend import TorchAttentionBackend
    from minillm.model.loader import resolve_arch
    from minillm.model.qwen3_moe import Qwen3MoeForCausalLM
    arch = resolve_arch("qwen3-30b-a3b")
    model = Qwen3MoeForCausalLM(arch, TorchAttentionBackend(), dtype=torch.bfloat16, device="meta")
    assert len(arch.moe_layers) == 48 and arch.num_experts == 128 and not arch.tie_word_embeddings
    assert sum(p.numel() for p in model.parameters()) == arch.num_params
    assert 30.4e9 < arch.num_params < 30.6e9      # about 61 GB in bf16
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (128, 1536, 2048)
    assert model.graph_unsupported_reason() is None   # bf16, 2048 / 768 rows: the graph-safe grouped_mm path
    fp16 = Qwen3MoeForCausalLM(arch, TorchAttentionBackend(), dtype=torch.float16, device="meta")
    assert "float16" in fp16.graph_unsupported_reason()


def test_megakernel_refuses_moe():
    from minillm.model.loader import resolve_arch
    from minillm.ops.megakernel import unsupported_reason
    assert "mixture-of-experts" in unsupported_reason(resolve_arch("qwen3-30b-a3b"), torch.bfloat16, 16, 1)
    assert unsupported_reason(resolve_arch("qwen3-0.6b"), torch.bfloat16, 16, 1) is None

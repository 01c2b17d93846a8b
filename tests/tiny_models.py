"""Test helpers: tiny random HF checkpoints, paged attention metadata, and HF transformers references.

Checkpoints are written by transformers itself (save_pretrained, safetensors), so the loader is tested against
the real file layout and names. Weights are re-drawn with a larger spread than HF's init (and random norm
weights and biases) so that every tensor matters and greedy decoding is not dominated by near-ties.
"""
from __future__ import annotations

import random
from pathlib import Path

import torch

from minillm.attention.metadata import AttentionMetadata


def make_tiny_checkpoint(path: str | Path, arch: str = "qwen3", *, hidden: int = 64, layers: int = 2,
                         heads: int = 4, kv_heads: int = 2, head_dim: int = 16, intermediate: int = 128,
                         vocab: int = 256, tie: bool = True, sharded: bool = False,
                         dtype: torch.dtype = torch.float32, seed: int = 0, max_positions: int = 512,
                         rope: dict | None = None) -> Path:
    """Write a random tiny Qwen3 or Qwen2 checkpoint to `path`; returns the path. `rope`: the config's
    rope_parameters (default: plain RoPE at theta 10000)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=tie,
                  max_position_embeddings=max_positions, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None,
                  rope_parameters=dict(rope or {"rope_type": "default", "rope_theta": 10000.0}))
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=head_dim, **common))
    elif arch == "qwen2":
        if hidden != heads * head_dim:
            raise ValueError("qwen2 derives head_dim from hidden/heads: need hidden == heads * head_dim")
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        raise ValueError(f"arch={arch!r}: one of qwen3, qwen2")
    _randomize(model, seed)
    path = Path(path)
    # A few KB per shard forces several files plus model.safetensors.index.json.
    shard = "20KB" if sharded else "10GB"
    model.to(dtype).save_pretrained(path, safe_serialization=True, max_shard_size=shard)
    return path


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def alloc_block_tables(seq_max_lens: list[int], block_size: int, seed: int = 0) -> tuple[list[list[int]], int]:
    """Random block tables for sequences that will grow up to `seq_max_lens` tokens.

    Only odd block ids are handed out, in shuffled order: no two blocks of a table are ever adjacent by
    accident, and block 0 (what unused table entries point at) plus every even block stay unowned.
    Returns (tables, num_blocks the cache needs).
    """
    need = [-(-n // block_size) for n in seq_max_lens]
    ids = list(range(1, 2 * sum(need) + 1, 2))
    random.Random(seed).shuffle(ids)
    tables, start = [], 0
    for n in need:
        tables.append(ids[start:start + n])
        start += n
    return tables, 2 * sum(need) + 1


def build_metadata(seqs: list[tuple[int, int]], block_size: int, block_tables: list[list[int]], *,
                   num_padding: int = 0, device: torch.device | str = "cpu") -> AttentionMetadata:
    """Metadata for one step over `seqs` = [(context_len_before, num_new_tokens), ...] in row order.

    Leading sequences with one new token count as decode rows (the runner puts decodes first).
    `num_padding` appends CUDA-graph-style padding rows whose slot is -1.
    """
    query_lens = [new for _, new in seqs]
    seq_lens = [ctx + new for ctx, new in seqs]
    num_decodes = 0
    while num_decodes < len(seqs) and query_lens[num_decodes] == 1:
        num_decodes += 1
    slots = []
    for (ctx, new), table in zip(seqs, block_tables, strict=True):
        if -(-(ctx + new) // block_size) > len(table):
            raise ValueError(f"block table of {len(table)} blocks is too short for {ctx + new} tokens")
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + new)]
    width = max(len(t) for t in block_tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    return AttentionMetadata(
        num_seqs=len(seqs), num_decodes=num_decodes, num_tokens=qsl[-1], max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        slot_mapping=torch.tensor(slots + [-1] * num_padding, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device), block_size=block_size,
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)


def flat_positions(seqs: list[tuple[int, int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """Positions of the new tokens of `seqs`, concatenated in row order."""
    pos = [p for ctx, new in seqs for p in range(ctx, ctx + new)]
    return torch.tensor(pos, dtype=torch.int64, device=device)


def _hf_model(path: str | Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(path: str | Path, token_ids: list[int]) -> torch.Tensor:
    """fp32 logits [len(token_ids), vocab] of one full forward of HF transformers on CPU."""
    out = _hf_model(path)(input_ids=torch.tensor([token_ids]))
    return out.logits[0].float()


@torch.no_grad()
def hf_greedy(path: str | Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """New token ids of HF generate (fp32, CPU, greedy) for one prompt; the tiny models have no EOS."""
    model = _hf_model(path)
    out = model.generate(input_ids=torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                         dtype=torch.long), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


DEMO_MODEL = Path(__file__).resolve().parents[1] / "minillm" / "demo_model"


def with_demo_tokenizer(path: Path, files=("tokenizer.json", "tokenizer_config.json", "generation_config.json")
                        ) -> Path:
    """Give a tiny checkpoint (vocab 4096) the demo model's tokenizer files, for text and chat prompts."""
    import shutil
    for name in files:
        shutil.copy(DEMO_MODEL / name, Path(path) / name)
    return Path(path)



def with_tensors(src: str | Path, dst: str | Path, tensors) -> Path:
    """A copy of checkpoint `src` at `dst` whose model.safetensors has `tensors` added or replaced; `tensors` is a
    dict, or a function of the checkpoint's weights that returns one."""
    import shutil

    from safetensors.torch import load_file, save_file
    dst = Path(dst)
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    weights.update(tensors(weights) if callable(tensors) else tensors)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def make_tiny_moe_checkpoint(path: str | Path, *, experts: int = 8, top_k: int = 2, norm_topk_prob: bool = True,
                             mlp_only_layers: list[int] | None = None, decoder_sparse_step: int = 1,
                             hidden: int = 64, layers: int = 3, heads: int = 4, kv_heads: int = 2,
                             head_dim: int = 16, intermediate: int = 96, moe_intermediate: int = 32,
                             vocab: int = 256, tie: bool = False, fused: bool = False, seed: int = 0,
                             max_positions: int = 512, router_std: float = 0.5) -> Path:
    """Write a random tiny Qwen3-MoE checkpoint. transformers' save_pretrained writes the hub layout (one tensor
    per expert and projection); fused=True writes its in-memory layout instead (3-D gate_up_proj / down_proj per
    layer), the other layout the loader accepts. The router weights are drawn with std `router_std` (5x the other
    weights), so routing is decisive (few near-ties between experts) and different tokens pick different experts."""
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         moe_intermediate_size=moe_intermediate, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim, num_experts=experts,
                         num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob,
                         mlp_only_layers=list(mlp_only_layers or []), decoder_sparse_step=decoder_sparse_step,
                         tie_word_embeddings=tie, max_position_embeddings=max_positions, rms_norm_eps=1e-6,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = Qwen3MoeForCausalLM(cfg)
    _randomize(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(router_std / 0.1)   # _randomize drew std 0.1
    path = Path(path)
    if not fused:
        model.save_pretrained(path, safe_serialization=True)
        return path
    path.mkdir(parents=True, exist_ok=True)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    cfg.save_pretrained(path)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path

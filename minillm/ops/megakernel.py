"""The persistent decode kernel ("megakernel", cuda/decode_megakernel.cu) from Python.

One launch runs every decoder layer of a decode step for up to 16 sequences (one new token each): embedding,
norms, QKV, q/k norm + RoPE, the KV-cache write, paged attention, o_proj, SwiGLU MLP and the final norm. The LM head
and the sampler stay outside (cuBLAS is at the floor there). docs/megakernel.md has the design and its costs.

What lives here, all plain torch so it runs and is tested on the CPU:
- weight packing into the kernel's granule order (pack_granules, pack_gate_up) and the A-fragment layout of its
  activation buffers (act_fragment_index), with an emulation of the tensor-core arithmetic for the CPU tests;
- the two plans the kernel computes for itself, mirrored: the attention work split (partition_plan) and the
  shared-memory budget (smem_plan); unsupported_reason() says why a shape or GPU is not covered;
- DecodeMegakernel: packs a loaded model once, owns the workspaces, forward() launches the op without a host sync
  or a data-dependent allocation (CUDA-graph safe; minillm/runner/cuda_graphs.py: MegakernelGraphs captures it per
  batch size);
- reference_decode_step: the torch twin (the model's own torch path on the same inputs).

Memory: the packed weights are a second copy of the decoder layers' weights (Qwen3-0.6B: 0.84 GB); the regular
path keeps its own for prefill.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.ops.coverage import KernelCoverage

GRANULE = 8            # weight rows per granule (the n8 of an mma B operand)
MAX_BATCH = 16         # decode rows: the 16 rows of the mma A operand
MAX_LAYERS = 64
MAX_HIDDEN = 2048      # a norm row is held in registers
MAX_GRANULES = 8       # granules one CTA may own in a phase (gate and up count one each)
MAX_PARTITIONS = 256
WARPS = 8
CHUNK = 16             # tokens per attention step of a warp
HEAD_DIMS = (64, 128)
BLOCK_SIZES = (16, 32)
DTYPES = (torch.bfloat16, torch.float16)
MAX_GROUP = 16
DEFAULT_SMEM_LIMIT = 232448   # bytes of opt-in shared memory per block on sm_90
MIN_PARTITION_CHUNKS = 8   # the default of kernels.megakernel_min_chunks
PROF_POINTS = 20       # timeline stamps per layer (megakernel.h: kMegaProfPoints)
# Weight-issue schedules of a stamped launch, forward(schedule=...): the op's profile_flags (megakernel.h)
PROF_SCHEDULES = {"ahead": 0, "serial": 1}
ACT_PAD = 8            # elements of padding per row of the shared A tile (decode_megakernel.cu: kActPad)


# ---- weight and activation layouts -------------------------------------------------------------------------------

def pack_granules(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> flat [N * K] in granule order (cuda/megakernel.h): granule g (rows 8g..8g+7) is K/32
    blocks of 32 lanes x 8 elements; lane l = 4r + q of block p holds W[8g + r][32p + 8t + 2q + e] at position
    2t + e, i.e. the B operands of mma k-steps 2p (t = 0, 1) and 2p + 1 (t = 2, 3)."""
    n, k = w.shape
    if n % GRANULE or k % 32:
        raise ValueError(f"weight [{n}, {k}]: rows must be a multiple of {GRANULE} and columns of 32")
    return w.reshape(n // 8, 8, k // 32, 4, 4, 2).permute(0, 2, 1, 4, 3, 5).reshape(-1)


def unpack_granules(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of pack_granules."""
    return packed.reshape(n // 8, k // 32, 8, 4, 4, 2).permute(0, 2, 1, 4, 3, 5).reshape(n, k)


def pack_gate_up(w: torch.Tensor) -> torch.Tensor:
    """gate_up [2I, K] (gate rows, then up rows) -> gate granule j followed by up granule j, for every j, so that
    the CTA owning intermediate rows 8j..8j+7 reads its gate and up rows as one contiguous range."""
    two_i, k = w.shape
    inter = two_i // 2
    gate = pack_granules(w[:inter]).view(inter // 8, 8 * k)
    up = pack_granules(w[inter:]).view(inter // 8, 8 * k)
    return torch.stack([gate, up], dim=1).reshape(-1)


def act_fragment_index(m: torch.Tensor | int, k: torch.Tensor | int, width: int):
    """Element index of (batch row m < 16, column k) in a global row-fragment buffer of 16 rows of `width` columns
    (megakernel.h): row m is contiguous; its 16 bytes at (k-pair k // 32, quad position q = (k % 8) // 2) hold
    words (k % 32 >= 16) * 2 + (k % 16 >= 8), i.e. the A registers a0/a2 (a1/a3 for rows 8..15) of mma lane
    4 (m % 8) + q for both k-steps of the k-pair."""
    word = (k % 32 >= 16) * 2 + (k % 16 >= 8) * 1
    return (((m * (width // 32) + k // 32) * 4 + (k % 8) // 2) * 4 + word) * 2 + k % 2


def pack_act_fragments(x: torch.Tensor) -> torch.Tensor:
    """[rows <= 16, K] -> flat [16 * K] row fragments (rows past x's are zero)."""
    rows, k = x.shape
    out = torch.zeros(16 * k, dtype=x.dtype, device=x.device)
    m = torch.arange(rows, device=x.device)[:, None].expand(rows, k)
    kk = torch.arange(k, device=x.device)[None, :].expand(rows, k)
    out[act_fragment_index(m, kk, k).reshape(-1)] = x.reshape(-1)
    return out


def act_tile_stride(hidden: int) -> int:
    """Row stride (elements) of the shared-memory A tile the kernel's norms write: 16 rows of hidden + ACT_PAD, an
    odd number of 16-byte chunks, so that the 8 rows one ldmatrix phase reads lie in 8 different bank groups."""
    return hidden + ACT_PAD


def ldmatrix_a_words(tile: torch.Tensor, k: int, stride: int) -> torch.Tensor:
    """The A registers [k / 16, lane, reg, half] that gemv_smem_a gets from a row-major shared tile (flat, row m of
    width k at m * stride), built from its per-lane addresses (lane l: row l % 16, column 16 ks + 8 (l / 16)) and
    the PTX rule of ldmatrix.x4 (lanes 8j..8j+7 address the 8 rows of matrix j; lane t receives elements
    2 (t % 4), +1 of row t / 4 of matrix j in register j)."""
    words = torch.zeros(k // 16, 32, 4, 2, dtype=tile.dtype)
    for ks in range(k // 16):
        addr = [(lane % 16) * stride + 16 * ks + 8 * (lane // 16) for lane in range(32)]
        for t in range(32):
            for j in range(4):
                base = addr[8 * j + t // 4] + 2 * (t % 4)
                words[ks, t, j] = tile[base:base + 2]
    return words


def ldmatrix_bank_groups(k: int, stride: int) -> list[list[int]]:
    """16-byte bank groups (of 8) of the 8 row addresses in each ldmatrix phase of gemv_smem_a, element size 2:
    a phase is conflict-free when its 8 groups differ."""
    phases = []
    for ks in range(k // 16):
        addr = [(lane % 16) * stride + 16 * ks + 8 * (lane // 16) for lane in range(32)]
        phases += [[(addr[8 * j + i] * 2 // 16) % 8 for i in range(8)] for j in range(4)]
    return phases


def global_a_words(act: torch.Tensor, k: int, batch: int = 16) -> torch.Tensor:
    """The A registers [k / 16, lane, reg, half] that gemv_global_a loads from a row-fragment buffer: lane
    (g = l / 4, q = l % 4) reads the 16 bytes of row g (registers 0, 2) and of row g + 8 (registers 1, 3) at each
    k-pair, word 2 (step % 2) + reg / 2 of them; rows >= batch are not read and count as zeros."""
    words = torch.zeros(k // 16, 32, 4, 2, dtype=act.dtype)
    flat = act.view(-1, 4, 2)                                  # [16-byte slot * 4 words, ...] -> per u32 word
    kpairs = k // 32
    for step in range(k // 16):
        kp, t = step // 2, step % 2
        for lane in range(32):
            g, q = lane // 4, lane % 4
            for reg in range(4):
                row = g + 8 * (reg % 2)
                if row >= batch:
                    continue
                slot = (row * kpairs + kp) * 4 + q
                words[step, lane, reg] = flat[slot, 2 * t + reg // 2]
    return words


def global_a_rounds(kpairs: int, batch: int, warps: int = WARPS, k_round: int = 8) -> list[list[list[int]]]:
    """The k-pairs each warp of gemv_global_a multiplies, round by round (one round = one L2 round trip): warp w
    takes k-pairs [w kpairs / warps, (w + 1) kpairs / warps); a round holds k_round k-pairs, 2 k_round at
    batch <= 8 (rows 8..15 are dead and their registers carry row g of the next k_round k-pairs)."""
    out = []
    for w in range(warps):
        begin, end = w * kpairs // warps, (w + 1) * kpairs // warps
        second = k_round if batch <= 8 else 0
        rounds, kp0 = [], begin
        while kp0 < end:
            first = [kp0 + i for i in range(k_round) if kp0 + i < end]
            extra = [kp0 + k_round + i for i in range(k_round) if second and kp0 + k_round + i < end]
            rounds.append(first + extra)
            kp0 += k_round + second
        out.append(rounds)
    return out


def emulate_gemv(packed_w: torch.Tensor, act: torch.Tensor, n: int, k: int, a_words: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """What the kernel's tensor-core loop computes, [16, n] in fp32, built only from the PTX fragment rules of
    mma.m16n8k16 (A: a0a1 row g, a2a3 row g + 8, a4a5 col + 8, a6a7 both; B: b0b1 k = 2q, b2b3 k = 2q + 8, n = l / 4)
    applied to the per-lane words the kernel loads: a check of both layouts that needs no GPU. A is the global
    row-fragment buffer `act` (all 16 rows read), or the per-lane registers `a_words` (from ldmatrix_a_words or
    global_a_words)."""
    lanes = torch.arange(32)
    grp, q = lanes // 4, lanes % 4
    a_words = (global_a_words(act, k) if a_words is None else a_words).float()   # [step, lane, reg, half]
    w_words = packed_w.float().view(n // 8, k // 32, 32, 4, 2)  # [granule, pair, lane, t, half]
    a = torch.zeros(k // 16, 16, 16)
    for reg in range(4):
        for half in range(2):
            rows = grp + 8 * (reg % 2)
            cols = 2 * q + half + 8 * (reg // 2)
            a[:, rows, cols] = a_words[:, :, reg, half]
    out = torch.zeros(16, n)
    for g in range(n // 8):
        for p in range(k // 32):
            for t in range(4):
                step = 2 * p + t // 2
                b = torch.zeros(16, 8)                            # B[k][n] of this k-step
                b[2 * q + 8 * (t % 2), grp] = w_words[g, p, :, t, 0]
                b[2 * q + 8 * (t % 2) + 1, grp] = w_words[g, p, :, t, 1]
                if t % 2 == 0:
                    acc = torch.zeros(16, 8)
                acc = acc + a[step] @ b
                if t % 2 == 1:
                    out[:, 8 * g:8 * g + 8] += acc
    return out


# ---- plans the kernel makes for itself (mirrored, for tests and applies()) --------------------------------------

@dataclass(frozen=True)
class PartitionPlan:
    chunks_per_part: int          # the largest attention partition, in 16-token chunks
    parts: list[int]              # partitions per sequence
    lens: list[int]               # chunks per partition of each sequence (its last one may be shorter)
    base: list[int]               # first item of each sequence (items: sequence-major, KV head, partition)

    @property
    def items(self) -> int:
        return self.base[-1]

    def token_ranges(self, b: int, ctx: int) -> list[tuple[int, int]]:
        """[start, end) of each partition of sequence b (context ctx)."""
        span = self.lens[b] * CHUNK
        return [(min(p * span, max(ctx, 0)), min(p * span + span, max(ctx, 0))) for p in range(self.parts[b])]


def partition_plan(seq_lens: list[int], num_kv_heads: int, num_ctas: int,
                   min_chunks: int = MIN_PARTITION_CHUNKS) -> PartitionPlan:
    """The attention work split of decode_megakernel.cu (make_plan): partitions of whole 16-token chunks, at most
    `per` long where `per` is just large enough that the items never outnumber the CTAs when B x Hkv leaves room
    (and at least min_chunks); one partition per sequence otherwise. A sequence's partitions are equal but for
    the last."""
    chunks = [-(-c // CHUNK) if c > 0 else 0 for c in seq_lens]
    slack = num_ctas - num_kv_heads * len(seq_lens)
    per = 1 << 24
    if slack > 0:
        per = min(max(-(-num_kv_heads * sum(chunks) // slack), max(min_chunks, 1)), 1 << 24)
    parts = [max(1, -(-c // per)) for c in chunks]
    lens = [-(-c // p) for c, p in zip(chunks, parts)]
    base = [0]
    for p in parts:
        base.append(base[-1] + p * num_kv_heads)
    return PartitionPlan(per, parts, lens, base)


def smem_plan(hidden: int, inter: int, num_heads: int, num_kv_heads: int, head_dim: int, num_ctas: int) -> dict:
    """Shared-memory regions (bytes) of one CTA, as megakernel_smem_plan computes them: w0 (QKV / gate_up slices),
    w1 (o_proj / down slices), uni (norm output, GEMV partial sums, attention ring and merges), qtile, misc
    (2 mbarriers, 2 paced-copy states of 32 bytes, the CTA's 4 slices of 24 bytes, the attention plan of 3 + 4 x 16 + 1 ints and the 2 x 16
    int64 positions and slots it copies), nw (the norm weight copied with each QKV / gate_up slice)."""
    def up(x: int) -> int:
        return -(-x // 128) * 128
    n, d, group = num_ctas, head_dim, num_heads // num_kv_heads
    nqkv, kq = (num_heads + 2 * num_kv_heads) * d, num_heads * d
    gq, gp, go = -(-nqkv // 8 // n), -(-inter // 8 // n), -(-hidden // 8 // n)
    max_gran = max(gq, 2 * gp, go)
    plan = dict(w0=up(2 * max(gq * 8 * hidden, gp * 16 * hidden)), w1=up(2 * max(go * 8 * kq, go * 8 * inter)))
    red_offset = up(16 * act_tile_stride(hidden) * 2)   # the GEMV sums follow the A tile (not over it)
    uni = max(red_offset + WARPS * max_gran * 32 * 16, WARPS * (128 // d) * 2 * CHUNK * d * 2,
              WARPS * group * d * 4 + 2 * WARPS * group * 4, 2 * group * MAX_PARTITIONS * 4 + group * 4)
    misc = 16 + 2 * 32 + 96 + 4 * (3 + 4 * MAX_BATCH + 1) + 8 * 2 * MAX_BATCH
    plan.update(uni=up(uni), qtile=up(2 * (MAX_BATCH * (d + 8) + 2 * d)), misc=up(misc), nw=up(2 * hidden))
    plan["total"] = sum(plan.values())
    plan["max_granules"] = max_gran
    return plan


# The generic part of what the kernel covers (decode_megakernel.cu: megakernel_smem_plan, launch_decode_megakernel;
# megakernel_bindings.cpp); unsupported_reason adds the model-shape and shared-memory limits. The launcher takes any
# power-of-two block size >= 16; the two the engine's other kernels cover are declared. Runs under CUDA graphs only.
COVERAGE = KernelCoverage("decode_megakernel", dtypes=("bfloat16", "float16"), head_dims=HEAD_DIMS,
                          block_sizes=BLOCK_SIZES, max_gqa_group=MAX_GROUP, min_capability=(9, 0), graph_safe=True)


def unsupported_reason(arch, dtype: torch.dtype, block_size: int, num_rows: int, *, num_ctas: int = 132,
                       smem_limit: int = DEFAULT_SMEM_LIMIT, capability: tuple[int, int] = (9, 0)) -> str | None:
    """Why the megakernel cannot run this decode step, or None when it can. arch: ModelArchConfig."""
    if getattr(arch, "num_experts", 0):
        return "a mixture-of-experts MLP (the megakernel's MLP phases are dense)"
    if tuple(capability) < COVERAGE.min_capability:
        return f"needs sm_90 (bulk copies, mbarrier transaction counts), GPU is sm_{capability[0]}{capability[1]}"
    if not 1 <= num_rows <= MAX_BATCH:
        return f"{num_rows} decode rows (supported: 1..{MAX_BATCH})"
    reason = COVERAGE.reason(dtype=str(dtype).removeprefix("torch."), capability=capability, head_dim=arch.head_dim,
                             num_q_heads=arch.num_attention_heads, num_kv_heads=arch.num_key_value_heads,
                             block_size=block_size)
    if reason is not None:
        return reason
    h, i = arch.hidden_size, arch.intermediate_size
    if h % 32 or i % 32 or h > MAX_HIDDEN:
        return f"hidden={h}, intermediate={i} (both multiples of 32, hidden <= {MAX_HIDDEN})"
    if not 1 <= arch.num_hidden_layers <= MAX_LAYERS:
        return f"{arch.num_hidden_layers} layers (supported: 1..{MAX_LAYERS})"
    plan = smem_plan(h, i, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, num_ctas)
    if plan["max_granules"] > MAX_GRANULES:
        return (f"a CTA would own {plan['max_granules']} weight granules in one phase on {num_ctas} SMs "
                f"(at most {MAX_GRANULES})")
    if plan["total"] > smem_limit:
        return f"needs {plan['total']} bytes of shared memory per CTA on {num_ctas} SMs, the GPU has {smem_limit}"
    return None


def device_limits(device: torch.device) -> dict:
    """num_ctas (SMs), smem_limit and capability of a CUDA device, as unsupported_reason takes them."""
    props = torch.cuda.get_device_properties(device)
    return dict(num_ctas=props.multi_processor_count, capability=(props.major, props.minor),
                smem_limit=getattr(props, "shared_memory_per_block_optin", DEFAULT_SMEM_LIMIT))


def applies(arch, dtype: torch.dtype, block_size: int, num_rows: int, device: torch.device | None = None) -> bool:
    """True when DecodeMegakernel covers this model, dtype, cache block size and batch on `device` (a CUDA
    device; the limits of an H200 when None)."""
    if device is not None and device.type != "cuda":
        return False
    limits = device_limits(device) if device is not None else {}
    return unsupported_reason(arch, dtype, block_size, num_rows, **limits) is None


# ---- the wrapper --------------------------------------------------------------------------------------------------

class DecodeMegakernel:
    """All decoder layers of a decode step of `model` in one kernel launch, for up to max_batch rows.

    kv_caches: the engine's per-layer (k_cache, v_cache), each [num_blocks, block_size, Hkv, D], contiguous; or
    None, and bind_caches() later (the engine packs the weights before it sizes the KV pool, so the pool is sized
    around them).
    forward(input_ids [B], positions [B], meta) -> hidden [B, H] (a view of a buffer owned here: copy it before
    the next call), after writing this step's k/v into the caches. The metadata must describe a decode-only step
    (row b = sequence b, one token each); padded rows carry slot -1 and a seq_len of at least 1.
    """

    def __init__(self, model, kv_caches, max_batch: int, block_size: int, max_model_len: int, *,
                 min_partition_chunks: int = MIN_PARTITION_CHUNKS, cooperative: bool = True):
        arch = model.arch
        embed = model.model.embed_tokens.weight
        self.device, self.dtype = embed.device, embed.dtype
        if self.device.type != "cuda":
            raise ValueError("DecodeMegakernel needs the model on a CUDA device")
        self.limits = device_limits(self.device)
        reason = unsupported_reason(arch, self.dtype, block_size, max_batch, **self.limits)
        if reason is not None:
            raise ValueError(f"the decode megakernel does not cover this model: {reason}")
        if max_model_len > model.cos_sin_cache.shape[0]:
            raise ValueError(f"max_model_len={max_model_len} exceeds the RoPE table ({model.cos_sin_cache.shape[0]})")
        self.arch, self.max_batch, self.block_size = arch, max_batch, block_size
        self.min_partition_chunks = min_partition_chunks
        # cooperative: launched so that every CTA is resident at once, which the grid barriers need
        self.cooperative = cooperative
        self._caches = None
        self._pack(model)
        self._alloc_workspaces()
        if kv_caches is not None:
            self.bind_caches(kv_caches)

    def bind_caches(self, kv_caches) -> None:
        arch, block_size = self.arch, self.block_size
        caches = [c for kv in kv_caches for c in kv]
        if len(caches) != 2 * arch.num_hidden_layers:
            raise ValueError(f"kv_caches has {len(kv_caches)} layers; the model has {arch.num_hidden_layers}")
        for c in caches:
            if tuple(c.shape[1:]) != (block_size, arch.num_key_value_heads, arch.head_dim) or not c.is_contiguous():
                raise ValueError(f"KV cache of shape {tuple(c.shape)} (contiguous [num_blocks, {block_size}, "
                                 f"{arch.num_key_value_heads}, {arch.head_dim}] needed)")
        self._caches = caches

    @torch.no_grad()
    def _pack(self, model) -> None:
        a, layers = self.arch, model.model.layers
        h, i, d = a.hidden_size, a.intermediate_size, a.head_dim
        nqkv, kq, n = a.q_size + 2 * a.kv_size, a.q_size, a.num_hidden_layers
        new = lambda *shape: torch.empty(*shape, dtype=self.dtype, device=self.device)  # noqa: E731
        self.w_qkv, self.w_o = new(n, nqkv * h), new(n, h * kq)
        self.w_gu, self.w_down = new(n, 2 * i * h), new(n, h * i)
        for li, layer in enumerate(layers):
            self.w_qkv[li] = pack_granules(layer.self_attn.qkv_proj.weight)
            self.w_o[li] = pack_granules(layer.self_attn.o_proj.weight)
            self.w_gu[li] = pack_gate_up(layer.mlp.gate_up_proj.weight)
            self.w_down[li] = pack_granules(layer.mlp.down_proj.weight)
        bias = [layer.self_attn.qkv_proj.bias for layer in layers]
        self.b_qkv = torch.stack(bias).contiguous() if bias[0] is not None else None
        self.ln1 = torch.stack([layer.input_layernorm.weight for layer in layers]).contiguous()
        self.ln2 = torch.stack([layer.post_attention_layernorm.weight for layer in layers]).contiguous()
        if a.qk_norm:
            self.q_norm = torch.stack([layer.self_attn.q_norm.weight for layer in layers]).contiguous()
            self.k_norm = torch.stack([layer.self_attn.k_norm.weight for layer in layers]).contiguous()
        else:
            self.q_norm = self.k_norm = None
        self.embed = model.model.embed_tokens.weight
        self.final_norm = model.model.norm.weight
        self.cos_sin = model.cos_sin_cache
        self.eps, self.scale = a.rms_norm_eps, d ** -0.5

    def _alloc_workspaces(self) -> None:
        a = self.arch
        h, i, d = a.hidden_size, a.intermediate_size, a.head_dim
        nqkv, kq = a.q_size + 2 * a.kv_size, a.q_size
        group = a.num_attention_heads // a.num_key_value_heads
        dev = self.device
        self.num_ctas = self.limits["num_ctas"]
        self.act_ws = torch.zeros(MAX_BATCH * (nqkv + kq + i + h), dtype=self.dtype, device=dev)
        self.partials = torch.zeros(self.num_ctas * group * (d + 2), dtype=torch.float32, device=dev)
        self.sync = torch.zeros(4 + MAX_BATCH * a.num_key_value_heads, dtype=torch.int32, device=dev)
        self.out = torch.zeros(MAX_BATCH, h, dtype=self.dtype, device=dev)

    @property
    def packed_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w_qkv, self.w_o, self.w_gu, self.w_down))

    def profile_buffer(self) -> torch.Tensor:
        """A timeline buffer for forward(profile=...): (clock64, globaltimer) pairs per (layer, point, CTA)
        and one pair per CTA after the last layer (minillm/bench/megakernel_timeline.py reads it)."""
        n = (self.arch.num_hidden_layers * PROF_POINTS + 1) * self.num_ctas * 2
        return torch.zeros(n, dtype=torch.int64, device=self.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta,
                profile: torch.Tensor | None = None, schedule: str = "ahead") -> torch.Tensor:
        """The step's hidden rows. `profile`: a profile_buffer() to stamp (a separate, slower variant).
        `schedule` (with profile only, a diagnosis): "ahead" copies each weight slice a phase ahead (the plain
        kernel's schedule), "serial" just before it is waited for (no weight stream in flight)."""
        b = input_ids.shape[0]
        if self._caches is None:
            raise RuntimeError("DecodeMegakernel.forward before bind_caches()")
        if not 1 <= b <= self.max_batch:
            raise ValueError(f"{b} decode rows; this megakernel was built for 1..{self.max_batch}")
        a = self.arch
        torch.ops.minillm.decode_megakernel(
            input_ids, positions, meta.slot_mapping, meta.seq_lens, meta.block_tables, self._caches, self.embed,
            self.w_qkv, self.b_qkv, self.w_o, self.w_gu, self.w_down, self.ln1, self.ln2, self.q_norm, self.k_norm,
            self.final_norm, self.cos_sin, self.act_ws, self.partials, self.sync, self.out, a.num_attention_heads,
            a.num_key_value_heads, a.head_dim, a.intermediate_size, self.eps, self.scale, self.num_ctas,
            self.min_partition_chunks, self.cooperative, profile, PROF_SCHEDULES[schedule])
        return self.out[:b]

    __call__ = forward


# ---- the torch twin -----------------------------------------------------------------------------------------------

@torch.no_grad()
def reference_decode_step(model, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta) -> torch.Tensor:
    """hidden [B, H] of the model's pure-torch path for the same decode step (torch attention backend, torch
    norm/RoPE/SwiGLU, F.linear GEMMs), writing this step's k/v into kv_caches as the kernel does. The model's
    kernels are restored afterwards (QwenForCausalLM.torch_path)."""
    with model.torch_path():
        return model(input_ids, positions, kv_caches, meta)


def step_bytes(arch, seq_lens: list[int], dtype_bytes: int = 2) -> dict:
    """Bytes a decode step's decoder layers must read: their weights (norms included; embedding and LM head
    excluded) and the K/V of every context token."""
    h, i = arch.hidden_size, arch.intermediate_size
    per_layer = h * (arch.q_size + 2 * arch.kv_size) + arch.q_size * h + 3 * h * i + 2 * h
    weights = arch.num_hidden_layers * per_layer * dtype_bytes
    kv = sum(seq_lens) * arch.kv_bytes_per_token(dtype_bytes)
    return dict(weight_bytes=weights, kv_bytes=kv, total_bytes=weights + kv)


def floor_us(total_bytes: int, bandwidth: float = 4.2e12) -> float:
    """Microseconds to read total_bytes at `bandwidth` bytes/s (the H200's measured copy rate by default)."""
    return total_bytes / bandwidth * 1e6


__all__ = ["DecodeMegakernel", "applies", "unsupported_reason", "partition_plan", "smem_plan",
           "pack_granules", "unpack_granules", "pack_gate_up", "pack_act_fragments", "act_fragment_index",
           "emulate_gemv", "reference_decode_step", "step_bytes", "floor_us"]

"""KV-cache scales for an fp8 cache from a calibration prefill at start-up (cache.calculate_kv_scales).

Where the checkpoint has no k_scale / v_scale tensors, the runner prefills CALIBRATION_TOKENS tokens of a fixed
text, as sequences of CALIBRATION_SEQ_LEN (max_model_len if shorter), through the model into a scratch cache in
the model dtype (what an fp8 cache would quantize), in one step whatever the token budget (so the scales do not
depend on it, nor does anything chunked prefill, prefix hits or preemption change). It then sets each
(layer, K/V, KV head) scale to HEADROOM * amax / fp8_max: the largest calibration value lands at half the format's
range, so values up to twice it stay exact to the format's precision and larger ones saturate. A head whose amax
is 0 or not finite keeps 1.0. The prefill runs once, before the KV pool is sized, and frees its scratch cache.
"""
from __future__ import annotations

import logging

import torch

from minillm.cache.spec import KVCacheSpec
from minillm.ops.kv_quant import fp8_max

log = logging.getLogger("minillm.engine")

CALIBRATION_TOKENS = 1024
CALIBRATION_SEQ_LEN = 256
HEADROOM = 2.0

# Mixed content (prose, lists, code, numbers) so that K and V see more than one kind of token. Original text.
CALIBRATION_TEXT = """\
The harbour office opened at six. By then the night boats had tied up along the east wall, and the clerk, who had
kept the same ledger for eleven years, was already counting crates of mackerel, sprats and the occasional crab
that had climbed in by mistake. Weather: wind from the north-west, force 4 to 5, easing later; sea state moderate;
visibility good except in showers.

Questions the new apprentices ask most often:
1. Why does the tide table list two high waters a day, but only one on the 14th?
2. How many litres of diesel does a 12-metre trawler burn between here and the Dogger Bank?
3. Who decides which berth a visiting yacht gets when the marina is full?

def berth_for(length_m: float, draught_m: float, free: list[dict]) -> dict | None:
    # smallest free berth that fits, preferring the inner basin at low water
    fits = [b for b in free if b["length"] >= length_m and b["depth"] >= draught_m + 0.5]
    return min(fits, key=lambda b: (b["length"], not b["inner"]), default=None)

Quarterly landings (tonnes): Q1 412.5, Q2 388.0, Q3 501.25, Q4 297.75; total 1,599.5, up 3.2% on last year.
In the evening the cafe by the slipway fills with crews comparing catches, arguing about football and swapping
advice on engines, nets and the price of ice. Later, when the lights come on along the pier, it is quiet again.
"""


def calibration_ids(runner, n: int) -> torch.Tensor:
    """n token ids: the text above through the model's tokenizer, repeated to length (the demo and hub models);
    seeded random ids where the model has no tokenizer (dummy-weight presets)."""
    from minillm.tokenizer import Tokenizer

    vocab = runner.vocab_size   # the whole model's (a tensor-parallel rank's arch holds its vocabulary shard)
    ids: list[int] = []
    if runner.model_dir is not None and (runner.model_dir / "tokenizer.json").is_file():
        ids = [i for i in Tokenizer.from_dir(runner.model_dir).encode(CALIBRATION_TEXT) if i < vocab]
    if not ids:
        g = torch.Generator().manual_seed(runner.cfg.runtime.seed or 0)
        return torch.randint(0, vocab, (n,), generator=g)
    return torch.tensor((ids * (n // len(ids) + 1))[:n])


def scales_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[layers, 2, heads] amax -> fp32 scales HEADROOM * amax / fp8_max(dtype); 1.0 where amax is 0 or not finite."""
    scales = amax.float() * (HEADROOM / fp8_max(dtype))
    ok = torch.isfinite(scales) & (scales > 0)
    return torch.where(ok, scales, torch.ones_like(scales))


@torch.inference_mode()
def calibrate_kv_scales(runner, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The calibrated scales [layers, 2, heads] of `runner`'s model (loaded, its backend bound to the engine's
    fp8 spec, which is bound again on return)."""
    from minillm.runner.kv_sizing import prefill_batch

    n = CALIBRATION_TOKENS
    _, positions, meta, blocks = prefill_batch(runner, n, seq_len=CALIBRATION_SEQ_LEN)
    scratch_spec = KVCacheSpec.for_model(runner.arch, runner.cfg.cache.block_size, "auto", runner.dtype)
    engine_spec = runner.kv_spec
    runner.attn_backend.bind_kv_cache(scratch_spec)
    try:
        scratch = scratch_spec.allocate(blocks, runner.device)
        runner.model(calibration_ids(runner, n).to(runner.device), positions, scratch, meta)
        slots = meta.slot_mapping[:n]
        amax = torch.stack([torch.stack([c.flatten(0, 1)[slots].abs().amax(dim=(0, 2)) for c in kv])
                            for kv in scratch]).float().cpu()
    finally:
        runner.attn_backend.bind_kv_cache(engine_spec)
    del scratch
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()
    scales = scales_from_amax(amax, fp8_dtype)
    log.info("minillm: fp8 KV scales from a %d-token calibration prefill: K %.3g-%.3g, V %.3g-%.3g", n,
             scales[:, 0].min(), scales[:, 0].max(), scales[:, 1].min(), scales[:, 1].max())
    return scales

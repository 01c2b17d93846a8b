"""The kept-set rule check-kernels and the GPU threshold tests judge the truncation kernel by
(minillm/diagnostics/sampler_check.py), on CPU: it must pass agreeing thresholds, fail real differences, and
allow a difference only at the top-p boundary."""
import math

import torch

from minillm.diagnostics.sampler_check import BOUNDARY, kept_set_gap, preceding_mass


def test_preceding_mass_counts_the_tie_group_once():
    row = torch.tensor([0.0, 0.0, -1.0])
    got = preceding_mass(row, 3)
    total = 2 + math.exp(-1)
    assert torch.allclose(got, torch.tensor([0.0, 0.0, 2 / total], dtype=torch.float64))


def test_agreeing_thresholds_give_zero():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    thr = logits.max(-1, keepdim=True).values
    assert kept_set_gap(logits, thr, thr.clone(), None, None) == (0.0, "")


def test_a_difference_without_top_p_fails():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    top2 = logits.topk(2).values
    gap, where = kept_set_gap(logits, top2[:, 1:], top2[:, :1], None, torch.ones(2))
    assert gap == math.inf and "no top-p" in where


def test_nothing_kept_fails():
    logits = torch.zeros(1, 8)
    gap, where = kept_set_gap(logits, torch.ones(1, 1), torch.zeros(1, 1), None, None)
    assert gap == math.inf and "nothing kept" in where


def test_top_p_boundary_token_is_allowed_and_a_far_one_is_not():
    # masses 0.5, 0.25, 0.25 (logits log 2, 0, 0 after the max): with p = 0.5 the second value's preceding
    # mass is exactly p, so keeping or dropping it is a boundary case; with p = 0.3 it is 0.2 away
    logits = torch.tensor([[math.log(2.0), 0.0, 0.0]], dtype=torch.float64)
    keep_all, keep_top = torch.full((1, 1), -1.0, dtype=torch.float64), logits[:, :1].clone()
    gap, _ = kept_set_gap(logits, keep_all, keep_top, None, torch.tensor([0.5]))
    assert gap <= BOUNDARY
    gap, where = kept_set_gap(logits, keep_all, keep_top, None, torch.tensor([0.3]))
    assert abs(gap - 0.2) < 1e-6 and "row 0" in where   # p is float32, as the engine holds it

"""Programmatic dependent launch (PDL) of minillm's kernels (cuda/launch.h).

On Hopper a kernel launched with PDL may be scheduled while the kernel before it in the stream still runs; every
minillm kernel starts by waiting for that grid to finish (`griddepcontrol.wait`) and then lets the next one be
scheduled, so results do not change, only how much of each launch hides behind its predecessor. cuBLAS kernels
launch as before. Whether launches ask for it is a per-thread setting in the extension, on only inside
`pdl_launches(True)`: the model runner enters it, from its execution plan (config key kernels.pdl), around its own
launches and graph captures; a CUDA graph keeps what was captured. Direct op calls (tests, check-kernels) launch
plain kernels unless they ask.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


def pdl_supported(device) -> bool:
    """PDL needs sm_90 or newer."""
    return torch.cuda.get_device_capability(device)[0] >= 9


@contextmanager
def pdl_launches(on: bool):
    """Launch minillm's kernels with PDL inside the block when `on` (the previous setting comes back after)."""
    if not on:
        yield
        return
    prev = torch.ops.minillm.set_pdl_launches(True)
    try:
        yield
    finally:
        torch.ops.minillm.set_pdl_launches(prev)

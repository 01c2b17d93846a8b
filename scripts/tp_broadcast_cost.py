#!/usr/bin/env python3
"""What rank 0's per-step broadcast of the plain SchedulerOutput costs (tensor parallelism's control message).

    python3 scripts/tp_broadcast_cost.py                 # 2 ranks, gloo on this host's CPU
    python3 scripts/tp_broadcast_cost.py --ranks 4 --steps 2000

Times, per step shape (256 decode rows; 8 new 2048-token prompts; 1 decode row), the pickle of the message alone
and the whole torch.distributed broadcast_object_list to every rank (rank 0's wall time, median and p99 of
--steps repeats). The engine sends this message over a gloo group on the host CPU whatever the device (NCCL
carries only tensors), so the numbers stand for a GPU host as well. Prints one JSON line per shape.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pickle
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minillm.contract import NewRequestData, SchedulerOutput  # noqa: E402
from minillm.sampling_params import SamplingParams  # noqa: E402


def shapes() -> dict[str, SchedulerOutput]:
    sp = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=256)
    decode = SchedulerOutput(req_ids=[f"cmpl-{i:032x}" for i in range(256)], starts=[1500 + i for i in range(256)],
                             num_tokens=[1] * 256, sample=[True] * 256,
                             new_block_ids={f"cmpl-{i:032x}": [4000 + i] for i in range(0, 256, 16)},
                             num_batched_tokens=256, step_id=7)
    new = [NewRequestData(f"cmpl-{i:032x}", list(range(2048)), sp, frozenset({151645}), list(range(i * 128, i * 128 + 128)))
           for i in range(8)]
    prefill = SchedulerOutput(req_ids=[r.req_id for r in new], starts=[0] * 8, num_tokens=[2048] * 8,
                              sample=[True] * 8, new_requests=new, num_batched_tokens=16384, step_id=8)
    one = SchedulerOutput(req_ids=["cmpl-0"], starts=[100], num_tokens=[1], sample=[True], num_batched_tokens=1)
    return {"decode_256": decode, "prefill_8x2048": prefill, "decode_1": one}


def _rank(rank: int, world: int, init: str, steps: int, queue) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    for name, so in shapes().items():
        times = []
        for _ in range(steps):
            box = [so] if rank == 0 else [None]
            dist.barrier()
            t = time.perf_counter()
            dist.broadcast_object_list(box, src=0)
            times.append(time.perf_counter() - t)
        if rank == 0:
            t = time.perf_counter()
            for _ in range(steps):
                pickle.dumps(so)
            pickle_s = (time.perf_counter() - t) / steps
            times.sort()
            queue.put({"shape": name, "ranks": world, "bytes": len(pickle.dumps(so)),
                       "pickle_us": round(pickle_s * 1e6, 1),
                       "broadcast_p50_us": round(statistics.median(times) * 1e6, 1),
                       "broadcast_p99_us": round(times[int(0.99 * (len(times) - 1))] * 1e6, 1)})
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=500)
    args = p.parse_args()
    mp = multiprocessing.get_context("spawn")
    queue = mp.Queue()
    with tempfile.TemporaryDirectory() as d:
        init = f"file://{os.path.join(d, 'rendezvous')}"
        procs = [mp.Process(target=_rank, args=(r, args.ranks, init, args.steps, queue)) for r in range(args.ranks)]
        for proc in procs:
            proc.start()
        for _ in shapes():
            print(json.dumps(queue.get(timeout=600)), flush=True)
        for proc in procs:
            proc.join(60)
    return 0 if all(proc.exitcode == 0 for proc in procs) else 1


if __name__ == "__main__":
    sys.exit(main())

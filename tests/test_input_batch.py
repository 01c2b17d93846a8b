"""InputBuilder against a from-scratch reference over random schedules.

The builder keeps block-table rows across steps, reuses the rows of an unchanged batch, copies only the block ids
a row's context grew into and lays decode-only steps out without cumsum/repeat; none of that may change a byte
of its output. A real Scheduler makes the schedules: prefills, chunked prefills, mixed batches, preemption and
recompute, prefix hits, aborts, and long runs of plain decodes whose blocks fill up.
"""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.engine.outputs import ModelRunnerOutput, SchedulerOutput
from minillm.request import Request
from minillm.runner.input_batch import InputBuilder, StepInputs
from minillm.sampling_params import SamplingParams
from sched_strategies import make_scheduler, scheduler_configs, scripts

BS = 8
MAX_MODEL_LEN = 64

configs = scheduler_configs(num_blocks=(6, 32), budget=(4, 64), max_num_seqs=(1, 12), thresholds=[0, 0, 5])

requests = st.fixed_dictionaries({
    "prompt": st.lists(st.integers(0, 2), min_size=1, max_size=40),   # tiny vocabulary: prefix hits
    "max_tokens": st.integers(1, 40),
})

ops = scripts(requests, max_size=80, step_weight=2)


def reference(so: SchedulerOutput) -> dict:
    """The step's inputs built the plain way, token by token: (dtype, values) per field."""
    ids, pos, slots, qsl, logits = [], [], [], [0], []
    for req, start, n, sample in zip(so.requests, so.starts, so.num_tokens, so.sample):
        for t in range(start, start + n):
            ids.append(req.all_token_ids[t])
            pos.append(t)
            slots.append(req.block_ids[t // BS] * BS + t % BS)
        qsl.append(qsl[-1] + n)
        if sample:
            logits.append(qsl[-1] - 1)
    seq_lens = [start + n for start, n in zip(so.starts, so.num_tokens)]
    num_decodes = next((i for i, n in enumerate(so.num_tokens) if n != 1), len(so.num_tokens))
    width = -(-max(seq_lens) // BS)
    return {
        "input_ids": (torch.int64, ids), "positions": (torch.int64, pos), "slot_mapping": (torch.int64, slots),
        "query_start_loc": (torch.int32, qsl), "seq_lens": (torch.int32, seq_lens),
        "block_tables": (torch.int32, [(r.block_ids + [0] * width)[:width] for r in so.requests]),
        "logits_indices": (torch.int64, logits),
        "scalars": (len(so.requests), num_decodes, len(ids), max(so.num_tokens), max(seq_lens), qsl, seq_lens),
    }


def built(step: StepInputs) -> dict:
    m = step.meta
    tensors = {"input_ids": step.input_ids, "positions": step.positions, "slot_mapping": m.slot_mapping,
               "query_start_loc": m.query_start_loc, "seq_lens": m.seq_lens, "block_tables": m.block_tables,
               "logits_indices": step.logits_indices}
    out = {name: (t.dtype, t.tolist()) for name, t in tensors.items()}
    out["scalars"] = (m.num_seqs, m.num_decodes, m.num_tokens, m.max_query_len, m.max_seq_len,
                      m.query_start_loc_cpu, m.seq_lens_cpu)
    return out


@settings(max_examples=150, deadline=None)
@given(cfg=configs, first=st.lists(requests, min_size=1, max_size=12), script=ops)
def test_inputs_match_a_from_scratch_reference(cfg, first, script):
    sched = make_scheduler(cfg, BS, MAX_MODEL_LEN)
    builder = InputBuilder(cfg["max_num_seqs"], cfg["budget"], MAX_MODEL_LEN, BS, torch.device("cpu"))
    added = []

    def step(seed: int) -> None:
        so = sched.schedule()
        if so.is_empty:
            return
        assert built(builder.build(so)) == reference(so)
        ids = [r.request_id for r in so.sampled_requests()]
        advanced = sched.update(so, ModelRunnerOutput(ids, [(seed >> i) % 50 + 3 for i in range(len(ids))]))
        builder.release([r.request_id for r in advanced if r.is_finished])   # as the engine does

    for op, arg in [("add", r) for r in first] + script:
        if op == "add":
            rid = f"in-{len(added)}"
            added.append(rid)
            try:
                sched.add_request(Request(rid, arg["prompt"], SamplingParams(max_tokens=arg["max_tokens"])))
            except ValueError:
                pass
        elif op == "step":
            step(arg)
        elif added and sched.abort(added[arg % len(added)]):
            builder.release([added[arg % len(added)]])
    for i in range(len(added) * MAX_MODEL_LEN + 1):
        if not sched.has_unfinished_requests():
            break
        step(i * 7919)
    assert not builder.rows.row_of, "block-table rows outlived their requests"

"""The long-prompt workload file: 128 requests of 6k-8k random prompt tokens and 32-128 output tokens, fixed by
its recorded seed, fitting its max_model_len of 8,448."""
from pathlib import Path

from minillm.bench.workloads import load_workload

FILE = Path(__file__).resolve().parents[1] / "configs" / "workloads" / "long-prompt.yaml"


def test_long_prompt_workload_shape_and_seed():
    w = load_workload(FILE)
    assert (w.name, w.num_requests, w.max_model_len, w.seed) == ("long-prompt", 128, 8448, 27)
    assert all(6144 <= len(p) <= 8192 for p in w.prompts) and all(32 <= m <= 128 for m in w.max_tokens)
    assert max(len(p) + m for p, m in zip(w.prompts, w.max_tokens)) <= 8448
    again = load_workload(FILE)
    assert again.prompts == w.prompts and again.max_tokens == w.max_tokens   # the seed names one draw
    assert (w.input_tokens, w.output_tokens) == (923_644, 10_000)            # drift would break comparisons
    assert w.summary()["seed"] == 27

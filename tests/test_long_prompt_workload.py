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


def test_ttft_workloads_and_yarn_presets():
    from minillm.model.loader import resolve_arch
    for k, n in (("8k", 8192), ("32k", 32768), ("128k", 131072)):
        w = load_workload(FILE.with_name(f"ttft-{k}.yaml"))
        assert (w.num_requests, len(w.prompts[0]), w.max_tokens, w.max_model_len) == (1, n - 1, [1], n)
    assert resolve_arch("qwen3-8b").max_position_embeddings == 40960
    assert 8.1e9 < resolve_arch("qwen3-8b").num_params < 8.3e9          # Qwen3-8B: 8.2 B parameters
    for name in ("qwen3-0.6b-yarn", "qwen3-8b-yarn"):
        arch = resolve_arch(name)
        assert arch.max_position_embeddings == 131072 and arch.rope.rope_type == "yarn"

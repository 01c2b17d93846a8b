"""The start-up matrix (scripts/startup_matrix.py): on a GPU every case of the pairwise design (dtype x block size x
kernels.backend x eager x prefix cache x KV-cache dtype, the configurations that once crashed in graph capture, and
the presets)
serves a few tokens, each in its own process, or is refused up front with a ConfigError naming the key; none
crashes. The full product is the script's (results/startup_matrix.jsonl)."""
import importlib.util
import itertools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "startup_matrix.py"


def _matrix():
    spec = importlib.util.spec_from_file_location("startup_matrix", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_quick_design_covers_every_pair_and_the_known_crashes():
    m = _matrix()
    design = m.pairwise_design()
    for a, b in itertools.combinations(m.AXES, 2):
        assert {(c[a], c[b]) for c in design} == set(itertools.product(m.AXES[a], m.AXES[b])), (a, b)
    assert len(design) < len(m.full_design()) // 4
    quick = m.cases(True)
    assert all(any(all(c.get(k) == v for k, v in crash.items()) for c in quick) for crash in m.ONCE_CRASHED)
    assert {c["model"] for c in quick} >= {"qwen3-0.6b", "qwen2.5-0.5b"}


@pytest.mark.gpu
def test_every_quick_case_serves_or_is_refused_naming_the_key():
    m = _matrix()
    m.preload_extension()
    todo = m.cases(True)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda c: m.run_in_subprocess(c, 600), todo))
    crashed = [(r["config"], r["message"], r.get("traceback", r.get("stderr_tail", ""))[-800:])
               for r in results if r["result"] == "crashed"]
    assert crashed == []
    for r in results:
        cfg = r["config"]
        if r["result"] == "refused":
            assert cfg.get("kernels") == "cuda", r
            assert r["message"].startswith(("model.dtype: ", "cache.block_size: ")), r
            continue
        plan = r["plan"]
        graphs_ok = cfg.get("dtype", "bfloat16") != "float32" and cfg.get("block_size", 16) in (16, 32) \
            and cfg.get("kernels", "auto") != "torch" and not cfg.get("enforce_eager", False)
        assert plan["cuda_graphs"] == graphs_ok, r
        assert plan["plan"]["cuda_graphs"]["reason"]
        assert not [ln for ln in r["log"] if ln.startswith("ERROR")], r          # no capture failed
        eager_notices = [ln for ln in r["log"] if "without CUDA graphs" in ln]
        assert len(eager_notices) == (not graphs_ok and not cfg.get("enforce_eager", False)), r   # said once
    by_model = {r["config"]["model"]: r for r in results if set(r["config"]) == {"model", "device"}}
    if torch.cuda.get_device_capability() >= (9, 0):   # the default path on an H200: the persistent kernel too
        assert by_model["qwen3-0.6b"]["plan"]["megakernel_max_batch"] > 0

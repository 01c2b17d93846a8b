"""bench / latency-sweep end to end on a tiny random checkpoint (CPU): they finish, and write JSONL and PNG."""
import json

import pytest
from typer.testing import CliRunner

from minillm.bench.plots import plot_latency
from minillm.bench.report import BENCH_KEYS, LATENCY_KEYS, read_jsonl
from minillm.commands import app

OFFLINE = "kind: offline\nnum_requests: 8\nprompt_len: [8, 40]\noutput_len: [3, 6]\nmax_model_len: 128\n"
ONLINE = ("kind: online\nnum_requests: 8\nshort_prompt_len: [8, 24]\nlong_prompt_len: [60, 90]\n"
          "output_len: [3, 5]\nmax_model_len: 128\nseed: 7\n")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("tiny")
    cfg = Qwen3Config(vocab_size=10240, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=8192,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


def _invoke(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result


def test_bench_writes_jsonl(tiny, tmp_path):
    wl = tmp_path / "wl.yaml"
    wl.write_text(OFFLINE)
    out = tmp_path / "bench.jsonl"
    result = _invoke("bench", "--model", tiny, "--device", "cpu", "--num-requests", 4, "--workload", wl,
                     "--output", out, "--no-progress", "--budget", 64)
    (line,) = read_jsonl(out)
    assert set(BENCH_KEYS) <= set(line)
    assert line["engine"] == "minillm" and line["label"] == "chunked-64"
    assert line["workload"]["num_requests"] == 4 and line["workload"]["output_tokens"] > 0
    assert line["output_tok_s"] == pytest.approx(line["workload"]["output_tokens"] / line["wall_s"])
    assert line["config"]["scheduler"]["max_num_batched_tokens"] == 64
    assert line["config"]["model"]["max_model_len"] == 128
    # no GPU: the floor's work is computed, its seconds and fraction are null
    assert line["floor"]["kv_bytes"] > 0 and line["floor"]["floor_s"] is None
    assert line["kv_cache_tokens"] > 0 and line["kv_cache_tokens"] % line["config"]["cache"]["block_size"] == 0
    assert line["fingerprint"]["torch"] and line["commit"]
    assert "minillm bench (offline)" in result.output
    table = result.stdout.split("appended")[0]
    assert max(len(line) for line in table.splitlines()) <= 80


def test_bench_on_the_demo_model_fits_the_workload_and_says_what_a_cpu_run_costs(tmp_path):
    import torch
    wl = tmp_path / "wl.yaml"     # ids up to 10,000 and 4,096 positions: more than the demo model has
    wl.write_text("kind: offline\nnum_requests: 3\nprompt_len: [8, 30]\noutput_len: [2, 4]\nmax_model_len: 4096\n")
    out = tmp_path / "b.jsonl"
    result = _invoke("bench", "--model", "demo", "--device", "cpu", "--workload", wl, "-o", out, "--no-progress")
    (line,) = read_jsonl(out)
    assert line["workload"]["fitted"] == {"vocab_size": 4096, "max_model_len": 2048}
    assert line["config"]["model"]["max_model_len"] == 2048 and line["workload"]["output_tokens"] > 0
    assert "folded into the model's vocabulary of 4096" in result.stderr
    if not torch.cuda.is_available():
        assert "no GPU: running demo (3.4 M parameters) on the CPU" in result.stderr and "roughly" in result.stderr


def test_cpu_estimates_tell_minutes_from_hours():
    from minillm.bench.cpu_estimate import estimate_seconds
    from minillm.bench.workloads import reference_offline
    from minillm.config import EngineConfig
    from minillm.model.loader import resolve_arch
    rates = (10.5e9, 35e9)   # a 2-core machine: 10.5 GB/s copies, 35 GFLOP/s float32 matmuls
    w = reference_offline()
    preset = EngineConfig.from_kwargs("qwen3-0.6b")
    demo = EngineConfig.from_kwargs("demo")
    small = w.head(16).fit(4096, 2048)[0]
    assert estimate_seconds(resolve_arch("qwen3-0.6b"), w, preset, rates) > 3 * 3600
    assert 30 < estimate_seconds(resolve_arch("demo"), small, demo, rates) < 3 * 60    # measured there: 79 s
    assert 520 < estimate_seconds(resolve_arch("qwen3-0.6b"), w.head(4), preset, rates) < 2100   # measured: 1,043 s


def test_bench_table_fits_80_columns_and_keeps_long_labels():
    from rich.console import Console
    from minillm.bench.report import bench_table
    line = {"label": "chunked-16384+torch+unified+eager", "engine": "minillm", "workload": {"num_requests": 256},
            "config": {"scheduler": {"enable_chunked_prefill": True, "policy": "fcfs",
                                     "max_num_batched_tokens": 16384},
                       "runtime": {"attention": "torch", "attention_mode": "unified", "enforce_eager": True}},
            "wall_s": 1005.76, "output_tok_s": 23274.2, "total_tok_s": 148088.1, "preemptions": 10000,
            "floor": {"fraction_of_floor": 0.65}, "load_s": 12.3, "warmup_s": 3.2}
    console = Console(width=80, record=True, file=open("/dev/null", "w"))
    console.print(bench_table([line, dict(line, label="static")]))
    text = console.export_text()
    assert max(len(row.rstrip()) for row in text.splitlines()) <= 80
    assert "148,088" in text and "10000" in text and "65.0" in text
    assert "chunked-16384+torch+unified+eager" in "".join(text.split())   # folded over lines, not cut


def test_latency_sweep_writes_jsonl_and_png(tiny, tmp_path):
    wl = tmp_path / "online.yaml"
    wl.write_text(ONLINE)
    out, png = tmp_path / "lat.jsonl", tmp_path / "lat.png"
    _invoke("latency-sweep", "--model", tiny, "--device", "cpu", "--num-requests", 6, "--time-scale", 0.01,
            "--workload", wl, "--configs", "prefill-first,chunked-512", "--rates", "4,8", "--output", out,
            "--plot", png, "--no-progress")
    lines = read_jsonl(out)
    assert [(ln["label"], ln["rate"]) for ln in lines] == [
        ("prefill-first", 4.0), ("prefill-first", 8.0), ("chunked-512", 4.0), ("chunked-512", 8.0)]
    for ln in lines:
        assert set(LATENCY_KEYS) <= set(ln)
        assert ln["workload"]["seed"] == 7 and ln["time_scale"] == 0.01
        assert 0 < ln["ttft_p50_s"] <= ln["ttft_p99_s"] and ln["itl_p50_s"] <= ln["itl_max_s"]
    assert lines[0]["chunked"] is False and lines[2]["budget"] == 512
    assert png.stat().st_size > 0
    png.unlink()
    _invoke("latency-sweep", "--plot-only", out, "--plot", png)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bad_flags_exit_2(tmp_path):
    runner = CliRunner()
    bad = [["bench", "--engine", "vllm"], ["bench", "--policy", "lifo"], ["bench", "--workload", tmp_path / "no.yaml"],
           ["latency-sweep", "--rates", "4,-1"], ["latency-sweep", "--configs", "chunked-3"],
           ["latency-sweep", "--time-scale", "0"], ["bench", "--max-model-len", "512"]]
    for args in bad:
        result = runner.invoke(app, [str(a) for a in args])
        assert result.exit_code == 2, (args, result.output)


def test_plot_from_handmade_lines(tmp_path):
    lines = [{"kind": "latency", "label": f"chunked-{b}", "rate": r, "budget": b, "chunked": True,
              "attention_mode": "split", "ttft_p99_s": 0.1 * b / 512 / r, "itl_max_s": 0.01 * b / 512}
             for b in (512, 1024, 2048) for r in (4.0, 8.0)]
    lines += [{"kind": "latency", "label": "prefill-first", "rate": r, "budget": 8192, "chunked": False,
               "attention_mode": "split", "ttft_p99_s": 1.0, "itl_max_s": 0.5} for r in (4.0, 8.0)]
    path = plot_latency(lines, tmp_path / "fig.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="no latency lines"):
        plot_latency([{"kind": "bench"}], tmp_path / "none.png")
    (tmp_path / "r.jsonl").write_text(json.dumps(lines[0]) + "\nnot json\n")
    with pytest.raises(ValueError, match="r.jsonl:2"):
        read_jsonl(tmp_path / "r.jsonl")


@pytest.mark.gpu
def test_hf_peer_line(tiny, tmp_path):
    wl = tmp_path / "wl.yaml"
    wl.write_text(OFFLINE)
    out = tmp_path / "hf.jsonl"
    _invoke("bench", "--engine", "hf", "--model", tiny, "--num-requests", 2, "--workload", wl, "--output", out,
            "--no-progress")
    (line,) = read_jsonl(out)
    assert set(BENCH_KEYS) <= set(line) and line["engine"] == "hf" and line["workload"]["num_requests"] == 2
    assert line["floor"]["fraction_of_floor"] > 0

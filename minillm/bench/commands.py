"""`minillm bench` and `minillm latency-sweep`: typer-annotated command functions the CLI registers.

The engine flags are the CLI's shared ones (minillm.cli.engine_options). Engine settings resolve like every
other command (minillm.config_loader), lowest first: built-in defaults,
--config FILE (or, without it, the `engine` section of the suite file), --set, explicit flags, then what a
run/config entry of the suite names (so `--compare` still varies what it means to vary). The workload always
sets max_model_len, and a preset model name gets random `dummy` weights.
"""
# NOTE: no `from __future__ import annotations`: engine_options re-exports these signatures from minillm.cli,
# where string annotations naming this module's aliases could not be resolved.
import json
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
import yaml

from minillm.cli import EngineFlags, engine_options
from minillm.config import ConfigError, EngineConfig
from minillm.fingerprint import REPO_ROOT

PRESET_DIR = Path(__file__).resolve().parents[1] / "presets"
BENCH_SUITE = REPO_ROOT / "configs" / "bench.yaml"
LATENCY_SUITE = REPO_ROOT / "configs" / "latency.yaml"

NumRequestsOpt = Annotated[Optional[int], typer.Option("--num-requests", help="Run only the first N requests.")]
WorkloadOpt = Annotated[Optional[Path], typer.Option("--workload", help="Workload YAML instead of the reference.")]
ProgressOpt = Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")]


def _fail(message: str) -> typer.Exit:
    typer.echo(f"minillm: error: {message}", err=True)
    return typer.Exit(2)


def _read_suite(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"suite file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"suite file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"suite file {path} must hold a mapping")
    return data


def _section_sets(engine: dict) -> list[str]:
    """The suite's sectioned engine mapping as `section.key=value` strings (JSON values are valid YAML)."""
    if not isinstance(engine, dict) or not all(isinstance(v, dict) for v in engine.values()):
        raise ConfigError("suite key 'engine' must map sections (model, cache, scheduler, runtime) to mappings")
    return [f"{section}.{key}={json.dumps(value)}" for section, body in engine.items() for key, value in body.items()]


def _flags(engine: EngineFlags) -> dict:
    """The shared CLI engine flags under their LLM(...) keyword names; None = not given."""
    if engine.max_model_len is not None:
        raise ConfigError("--max-model-len: the workload sets max_model_len (2048 offline, 8192 online); "
                          "use --workload FILE.yaml for another")
    return {"model": engine.model, "device": engine.device, "dtype": engine.dtype,
            "max_num_batched_tokens": engine.budget, "enable_chunked_prefill": engine.chunked,
            "scheduling_policy": engine.policy, "attention": engine.attention,
            "attention_mode": engine.attention_mode, "enforce_eager": True if engine.eager else None}


def _build(suite: dict, engine: EngineFlags, entry: dict, max_model_len: int) -> EngineConfig:
    from minillm.config_loader import load_config

    base = [] if engine.config else _section_sets(suite.get("engine", {}))
    overrides = {k: v for k, v in entry.items() if k != "name"}
    cfg, _ = load_config(engine.config, [*base, *(engine.set or [])],
                         **{**_flags(engine), **overrides, "max_model_len": max_model_len})
    model = cfg.model.model
    if model and not Path(model).is_dir() and (PRESET_DIR / f"{model}.json").is_file() \
            and cfg.model.load_format == "auto":
        cfg = EngineConfig.from_kwargs(base=cfg, load_format="dummy")
    return cfg


def _label(cfg: EngineConfig) -> str:
    s, r = cfg.scheduler, cfg.runtime
    parts = [f"{'chunked' if s.enable_chunked_prefill else 'prefill-first'}-{s.max_num_batched_tokens}"]
    parts += [s.policy] if s.policy != "fcfs" else []
    parts += [r.attention] if r.attention != "auto" else []
    parts += [r.attention_mode] if r.attention_mode != "split" else []
    parts += ["eager"] if r.enforce_eager else []
    return "+".join(parts)


def _device(cfg: EngineConfig) -> str:
    import torch

    if cfg.runtime.device != "auto":
        return cfg.runtime.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def _prepare_device(device: str) -> dict:
    """Build/load the CUDA extension up front, so its compile time is reported on its own, not inside the first
    configuration's load time. The kernels each configuration ran are on its own line (`kernels`)."""
    from minillm.ops.build import ExtensionError, load_extension

    t0 = time.perf_counter()
    if device.startswith("cuda"):
        try:
            load_extension()
        except ExtensionError:
            pass   # each configuration resolves its kernels and says why they are unavailable
    return {"kernel_build_s": time.perf_counter() - t0}


def _offline_workload(workload: Path | None, num_requests: int | None):
    from minillm.bench.workloads import check_reference_totals, load_workload, reference_offline

    if workload is None:
        w = reference_offline()
        check_reference_totals(w)   # before any timing: a drifted generator makes every figure incomparable
    else:
        w = load_workload(workload)
    return w.head(num_requests)


@engine_options
def bench_command(
    num_requests: NumRequestsOpt = None, workload: WorkloadOpt = None,
    peer: Annotated[str, typer.Option("--engine", help="minillm | hf (transformers continuous batching)")] = "minillm",
    repeat: Annotated[int, typer.Option("--repeat", help="Timed passes per configuration (median reported).")] = 1,
    compare: Annotated[bool, typer.Option("--compare", help="Run every entry of the suite's runs list.")] = False,
    suite: Annotated[Path, typer.Option("--suite", help="Base engine + --compare runs.",
                                        show_default="configs/bench.yaml")] = BENCH_SUITE,
    output: Annotated[Path, typer.Option("--output", help="JSONL file to append to.")] = Path("results/bench.jsonl"),
    progress: ProgressOpt = True, *, engine: EngineFlags,
) -> None:
    """Offline throughput on the reference workload (DESIGN 6), with % of the hardware floor (DESIGN 7)."""
    from minillm.bench.floor import measure_device
    from minillm.bench.report import append_jsonl, bench_table, print_table

    try:
        if peer not in ("minillm", "hf"):
            raise ConfigError(f"--engine={peer!r} is not allowed: minillm or hf")
        if peer == "hf" and (compare or repeat != 1):
            raise ConfigError("--compare and --repeat apply to minillm runs; run --engine hf on its own")
        if not 1 <= repeat:
            raise ConfigError(f"--repeat={repeat!r} is not allowed: an integer >= 1")
        data = _read_suite(suite)
        w = _offline_workload(workload, num_requests)
        entries = data.get("runs", []) if compare else [{}]
        if not entries or not all(isinstance(e, dict) for e in entries):
            raise ConfigError(f"suite {suite}: 'runs' must be a non-empty list of mappings")
        cfgs = [(e.get("name"), _build(data, engine, e, w.max_model_len)) for e in entries]
    except ValueError as e:   # ConfigError included
        raise _fail(str(e)) from None
    dev = _device(cfgs[0][1])
    extra = _prepare_device(dev) if peer == "minillm" else {}
    rates = measure_device(dev)   # before any engine takes the GPU memory
    lines, failed = [], []
    for name, cfg in cfgs:
        try:
            line = _run_one(peer, cfg, name, w, rates, repeat, progress)
        except Exception as e:   # one broken configuration must not cost the others their measurement
            failed.append(f"{name or _label(cfg)}: {type(e).__name__}: {e}")
            continue
        lines.append(append_jsonl(output, {**line, **extra}))
    if lines:
        print_table(bench_table(lines))
    typer.echo(f"appended {len(lines)} line(s) to {output}")
    _report_failures(failed)


def _report_failures(failed: list[str]) -> None:
    for message in failed:
        typer.echo(f"failed: {message}", err=True)
    if failed:
        raise typer.Exit(1)


def _run_one(peer: str, cfg: EngineConfig, name: str | None, w, rates, repeat: int, progress: bool) -> dict:
    from minillm.bench.hf_peer import run_hf
    from minillm.bench.offline import run_config

    if peer == "hf":
        device = _device(cfg)
        dtype = cfg.model.dtype if cfg.model.dtype != "auto" else ("bfloat16" if device.startswith("cuda")
                                                                   else "float32")
        return run_hf(cfg.model.model, w, rates, device, dtype, show_progress=progress)
    return run_config(cfg, w, rates, name or _label(cfg), repeat, progress)


def _parse_rates(rates: str) -> list[float]:
    try:
        values = [float(x) for x in rates.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(v > 0 for v in values):
        raise ConfigError(f"--rates={rates!r} is not allowed: comma-separated request rates > 0, e.g. 4,8")
    return values


def _pick_configs(entries, names: str | None) -> list[dict]:
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) and "name" in e for e in entries):
        raise ConfigError("suite key 'configs' must be a non-empty list of mappings, each with a name")
    if names is None:
        return entries
    by_name = {e["name"]: e for e in entries}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in by_name]
    if unknown or not wanted:
        raise ConfigError(f"--configs={names!r}: unknown {unknown}; known: {', '.join(by_name)}")
    return [by_name[n] for n in wanted]


def _online_workload(data: dict, workload: Path | None, num_requests: int | None):
    from minillm.bench.workloads import load_workload, online_workload

    w = load_workload(workload) if workload else online_workload(**data.get("workload", {}))
    if w.unit_arrivals is None:
        raise ConfigError(f"workload {w.name!r} has no arrivals: latency-sweep needs kind: online")
    return w.head(num_requests)


@engine_options
def latency_sweep_command(
    num_requests: NumRequestsOpt = None, workload: WorkloadOpt = None,
    rates: Annotated[Optional[str], typer.Option("--rates", help="Comma-separated req/s (default: suite's).")] = None,
    configs: Annotated[Optional[str], typer.Option("--configs", help="Comma-separated config names.")] = None,
    time_scale: Annotated[float, typer.Option("--time-scale", help="Multiply arrival gaps (tiny runs).")] = 1.0,
    suite: Annotated[Path, typer.Option("--suite", help="Base engine, rates, workload, configs.",
                                        show_default="configs/latency.yaml")] = LATENCY_SUITE,
    output: Annotated[Path, typer.Option("--output", help="JSONL file to append to.")] = Path("results/latency.jsonl"),
    plot: Annotated[Path, typer.Option("--plot", help="PNG to write.")] = Path("results/latency.png"),
    plot_only: Annotated[Optional[Path], typer.Option("--plot-only", help="Redraw from a results JSONL.")] = None,
    target: Annotated[Optional[str], typer.Option("--target", help="Replay against this OpenAI-compatible server "
                      "(http://HOST:PORT) instead; --configs NAME records the config it runs.")] = None,
    progress: ProgressOpt = True, *, engine: EngineFlags,
) -> None:
    """Online latency under Poisson arrivals (DESIGN 6): TTFT and ITL percentiles per config and rate."""
    from minillm.bench.plots import plot_latency
    from minillm.bench.report import append_jsonl, latency_table, print_table, read_jsonl

    try:
        if plot_only is not None:
            lines = read_jsonl(plot_only, kind="latency")
            print_table(latency_table(lines))
            typer.echo(f"wrote {plot_latency(lines, plot)}")
            return
        if not time_scale > 0:
            raise ConfigError(f"--time-scale={time_scale!r} is not allowed: a number > 0")
        data = _read_suite(suite)
        w = _online_workload(data, workload, num_requests)
        rate_list = _parse_rates(rates) if rates else _parse_rates(",".join(map(str, data.get("rates", []))))
        cfgs = [(e["name"], _build(data, engine, e, w.max_model_len))
                for e in _pick_configs(data.get("configs"), configs)]
        if target is not None and configs is not None and len(cfgs) != 1:
            raise ConfigError("--target measures one server: name at most one config with --configs")
    except ValueError as e:   # ConfigError included
        raise _fail(str(e)) from None
    if target is not None:   # the server serves; its rows are measured on the client side
        from minillm.bench.http_load import sweep_target
        lines, failed = sweep_target(target, w, rate_list, time_scale, progress, cfgs if configs else [],
                                     lambda line: append_jsonl(output, line))
    else:
        lines, failed = _sweep_in_process(cfgs, w, rate_list, time_scale, progress, output)
    if lines:
        print_table(latency_table(lines))
        typer.echo(f"appended {len(lines)} line(s) to {output}; wrote {plot_latency(lines, plot)}")
    _report_failures(failed)


def _sweep_in_process(cfgs, w, rate_list, time_scale, progress, output) -> tuple[list[dict], list[str]]:
    from minillm.bench.latency import run_sweep_config
    from minillm.bench.report import append_jsonl

    extra = _prepare_device(_device(cfgs[0][1]))
    lines, failed = [], []
    for name, cfg in cfgs:
        try:
            new = run_sweep_config(cfg, name, w, rate_list, time_scale, progress)
        except Exception as e:   # as in bench: keep the other configurations' results
            failed.append(f"{name}: {type(e).__name__}: {e}")
            continue
        lines += [append_jsonl(output, {**line, **extra}) for line in new]
    return lines, failed


if __name__ == "__main__":
    # `python -m minillm.bench.commands bench ...`: the same commands without the package's console script
    # (scripts/device_bench.sh uses it so a fresh machine needs only `pip install -e . --no-deps`).
    _app = typer.Typer(add_completion=False)
    _app.command("bench")(bench_command)
    _app.command("latency-sweep")(latency_sweep_command)
    _app()

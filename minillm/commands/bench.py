"""`minillm bench` and `minillm latency-sweep`: parse flags, then hand over to minillm.bench."""
# NOTE: no `from __future__ import annotations`: engine_options reads these signatures with the aliases below.
from pathlib import Path
from typing import Annotated, Optional

import typer

from minillm.bench.suite import BENCH_SUITE, LATENCY_SUITE
from minillm.commands.common import fail
from minillm.commands.engine_flags import EngineFlags, engine_options
from minillm.config import ConfigError

NumRequestsOpt = Annotated[Optional[int], typer.Option("--num-requests", metavar="N",
                                                       help="Run only the first N requests.")]
WorkloadOpt = Annotated[Optional[Path], typer.Option("--workload", metavar="FILE",
                                                     help="Workload YAML instead of the reference.")]
ProgressOpt = Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")]
# Results go to a scratch folder of the working directory unless -o/--plot say where: a run from a checkout must
# not append to the tracked results/ files (those come from the GPU runs, which pass -o).
SCRATCH = Path("minillm-results")
CPU_SIZED_REQUESTS = 16   # the demo model on the first 16 reference requests: about a minute on 2 cores


@engine_options
def bench_command(
    num_requests: NumRequestsOpt = None, workload: WorkloadOpt = None,
    peer: Annotated[str, typer.Option("--engine", metavar="ENGINE",
                                      help="minillm | hf (transformers continuous batching)")] = "minillm",
    repeat: Annotated[int, typer.Option("--repeat", metavar="N",
                                        help="Timed passes per configuration (median reported).")] = 1,
    compare: Annotated[bool, typer.Option("--compare", help="Run every entry of the suite's runs list.")] = False,
    suite: Annotated[Path, typer.Option("--suite", metavar="FILE", help="Base engine + --compare runs.",
                                        show_default="configs/bench.yaml")] = BENCH_SUITE,
    output: Annotated[Path, typer.Option("--output", "-o", metavar="FILE",
                                         help="JSONL file to append to.")] = SCRATCH / "bench.jsonl",
    decode_sweep: Annotated[bool, typer.Option(
        "--decode-sweep", help="Instead: ms per decode step for B = 1..256 against the bandwidth floor "
                               f"({SCRATCH}/decode_steps.jsonl and decode_steps.png unless -o).")] = False,
    progress: ProgressOpt = True, *, engine: EngineFlags,
) -> None:
    """Offline throughput on the reference workload, with % of the hardware floor.

    The reference workload and the floor are described in docs/architecture.md.
    The model is the suite's unless --model names one: the Qwen3-0.6B preset
    with random weights. Without a GPU that takes hours on the CPU: it says
    so, and roughly how long, before it starts. A CPU-sized run (about a
    minute) uses the small demo model, its token ids folded into the model's
    vocabulary:

    \b
      minillm bench --model demo --num-requests 16
    """
    from minillm.bench.floor import measure_device
    from minillm.bench.report import append_jsonl, bench_table, print_table
    from minillm.bench.suite import device_of, label, offline_workload, prepare_device, read_suite

    if decode_sweep:
        return _decode_sweep(suite, engine, output)
    try:
        if peer not in ("minillm", "hf"):
            raise ConfigError(f"--engine={peer!r} is not allowed: minillm or hf")
        if peer == "hf" and (compare or repeat != 1):
            raise ConfigError("--compare and --repeat apply to minillm runs; run --engine hf on its own")
        if not 1 <= repeat:
            raise ConfigError(f"--repeat={repeat!r} is not allowed: an integer >= 1")
        data = read_suite(suite)
        w = offline_workload(workload, num_requests)
        entries = data.get("runs", []) if compare else [{}]
        if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
            raise ConfigError(f"suite {suite}: 'runs' must be a non-empty list of mappings")
        runs = [_fitted(e, w, data, engine) for e in entries]
    except (ValueError, OSError) as e:   # ConfigError included; OSError: a missing model directory
        fail(str(e))
    dev = device_of(runs[0][1])
    if dev == "cpu":
        _cpu_notice(runs[0][1], runs[0][2])
    extra = prepare_device(dev) if peer == "minillm" else {}
    rates = measure_device(dev)   # before any engine takes the GPU memory
    lines, failed = [], []
    for name, cfg, w in runs:
        try:
            line = _run_one(peer, cfg, name or label(cfg), w, rates, repeat, progress)
        except Exception as e:   # one broken configuration must not cost the others their measurement
            failed.append(f"{name or label(cfg)}: {type(e).__name__}: {e}")
            continue
        lines.append(append_jsonl(output, {**line, **extra}))
    if lines:
        print_table(bench_table(lines))
    typer.echo(f"appended {len(lines)} line(s) to {output}")
    _report_failures(failed)


def _decode_sweep(suite: Path, engine: EngineFlags, output: Path) -> None:
    """`bench --decode-sweep`: the suite's base engine (or --config), one decode-only run per batch size."""
    from minillm.bench.decode_sweep import sweep_and_record
    from minillm.bench.suite import build_config, device_of, read_suite

    try:
        cfg = build_config(read_suite(suite), engine.config, engine.set or [], engine.overrides(), {}, None)
    except (ValueError, OSError) as e:
        fail(str(e))
    if device_of(cfg) == "cpu":
        fail("--decode-sweep times decode steps on a GPU; none is visible")
    out = SCRATCH / "decode_steps.jsonl" if output == SCRATCH / "bench.jsonl" else output
    sweep_and_record(cfg, out)
    typer.echo(f"appended to {out}; figure {out.with_name('decode_steps.png')}")


def _fitted(entry: dict, w, data: dict, engine: EngineFlags) -> tuple:
    """(name, EngineConfig, workload) of one run, the workload fitted to the run's model (notes on stderr)."""
    from minillm.bench.suite import fit_workload

    fitted, cfg, notes = fit_workload(w, data, engine.config, engine.set or [], engine.overrides(), entry)
    for note in notes:
        typer.echo(f"minillm: workload {w.name}: {note}", err=True)
    return entry.get("name"), cfg, fitted


def _cpu_notice(cfg, w) -> None:
    """Say up front what a CPU run is in for (the 0.6B preset runs for hours), and offer a CPU-sized one."""
    from minillm.bench.cpu_estimate import estimate_seconds, format_duration, measure_cpu_rates
    from minillm.bench.workloads import reference_offline
    from minillm.config import EngineConfig
    from minillm.model.loader import resolve_arch

    rates = measure_cpu_rates()
    arch = resolve_arch(cfg.model.model, cfg.model.load_format)
    seconds = estimate_seconds(arch, w, cfg, rates)
    typer.echo(f"minillm bench: no GPU: running {cfg.model.model or 'the demo model'} ({arch.num_params / 1e6:,.1f} M "
               f"parameters) on the CPU, {w.num_requests} requests ({w.input_tokens:,} prompt + "
               f"{w.output_tokens:,} output tokens): roughly {format_duration(seconds)} on this machine.", err=True)
    if seconds > 600:
        demo = resolve_arch("demo")
        small, _ = reference_offline().head(CPU_SIZED_REQUESTS).fit(demo.vocab_size, demo.max_position_embeddings)
        quick = estimate_seconds(demo, small, EngineConfig.from_kwargs("demo"), rates)
        typer.echo(f"  A CPU-sized run: `minillm bench --model demo --num-requests {CPU_SIZED_REQUESTS}` (the "
                   f"{demo.num_params / 1e6:.1f} M-parameter demo model; roughly {format_duration(quick)}).",
                   err=True)


def _report_failures(failed: list[str]) -> None:
    for message in failed:
        typer.echo(f"failed: {message}", err=True)
    if failed:
        raise typer.Exit(1)


def _run_one(peer: str, cfg, name: str, w, rates, repeat: int, progress: bool) -> dict:
    from minillm.bench.hf_peer import run_hf
    from minillm.bench.offline import run_config
    from minillm.bench.suite import device_of

    if peer == "hf":
        device = device_of(cfg)
        dtype = cfg.model.dtype if cfg.model.dtype != "auto" else ("bfloat16" if device.startswith("cuda")
                                                                   else "float32")
        return run_hf(cfg.model.model, w, rates, device, dtype, show_progress=progress)
    return run_config(cfg, w, rates, name, repeat, progress)


@engine_options
def latency_sweep_command(
    num_requests: NumRequestsOpt = None, workload: WorkloadOpt = None,
    rates: Annotated[Optional[str], typer.Option("--rates", metavar="R1,R2",
                                                 help="Comma-separated req/s (default: suite's).")] = None,
    configs: Annotated[Optional[str], typer.Option("--configs", metavar="NAMES",
                                                   help="Comma-separated config names.")] = None,
    time_scale: Annotated[float, typer.Option("--time-scale", metavar="X",
                                              help="Multiply arrival gaps (tiny runs).")] = 1.0,
    suite: Annotated[Path, typer.Option("--suite", metavar="FILE", help="Base engine, rates, workload, configs.",
                                        show_default="configs/latency.yaml")] = LATENCY_SUITE,
    output: Annotated[Path, typer.Option("--output", "-o", metavar="FILE", help="JSONL file to append to.")]
    = SCRATCH / "latency.jsonl",
    plot: Annotated[Path, typer.Option("--plot", metavar="FILE", help="PNG to write.")] = SCRATCH / "latency.png",
    plot_only: Annotated[Optional[Path], typer.Option("--plot-only", metavar="FILE",
                                                      help="Redraw from a results JSONL.")] = None,
    target: Annotated[Optional[str], typer.Option("--target", metavar="URL", help="Replay against this "
                      "OpenAI-compatible server (http://HOST:PORT) instead; --configs NAME records the config it "
                      "runs.")] = None,
    progress: ProgressOpt = True, *, engine: EngineFlags,
) -> None:
    """Online latency under Poisson arrivals: TTFT and ITL percentiles per config and rate.

    The online reference workload is described in docs/architecture.md. The
    model is the suite's unless --model names one: the Qwen3-0.6B preset with
    random weights. On a model with fewer positions or a smaller vocabulary
    (the demo model), the workload is fitted to it first, and a note says
    what changed.
    """
    from minillm.bench.plots import plot_latency
    from minillm.bench.report import append_jsonl, latency_table, print_table, read_jsonl
    from minillm.bench.suite import online_workload, parse_rates, pick_configs, read_suite, suite_rates

    try:
        if plot_only is not None:
            lines = read_jsonl(plot_only, kind="latency")
            print_table(latency_table(lines))
            typer.echo(f"wrote {plot_latency(lines, plot)}")
            return
        if not time_scale > 0:
            raise ConfigError(f"--time-scale={time_scale!r} is not allowed: a number > 0")
        data = read_suite(suite)
        w = online_workload(data, workload, num_requests)
        rate_list = parse_rates(rates) if rates else suite_rates(data)
        runs = [_fitted(e, w, data, engine) for e in pick_configs(data.get("configs"), configs)]
        if target is not None and configs is not None and len(runs) != 1:
            raise ConfigError("--target measures one server: name at most one config with --configs")
    except (ValueError, OSError) as e:   # ConfigError included; OSError: a missing model directory
        fail(str(e))
    if target is not None:   # the server serves; its rows are measured on the client side
        from minillm.bench.http_load import sweep_target
        lines, failed = sweep_target(target, runs[0][2], rate_list, time_scale, progress,
                                     [(name, cfg) for name, cfg, _ in runs] if configs else [],
                                     lambda line: append_jsonl(output, line))
    else:
        lines, failed = _sweep_in_process(runs, rate_list, time_scale, progress, output)
    if lines:
        print_table(latency_table(lines))
        typer.echo(f"appended {len(lines)} line(s) to {output}; wrote {plot_latency(lines, plot)}")
    _report_failures(failed)


def _sweep_in_process(runs, rate_list, time_scale, progress, output) -> tuple[list[dict], list[str]]:
    from minillm.bench.latency import run_sweep_config
    from minillm.bench.report import append_jsonl
    from minillm.bench.suite import device_of, prepare_device

    extra = prepare_device(device_of(runs[0][1]))
    lines, failed = [], []
    for name, cfg, w in runs:
        try:
            new = run_sweep_config(cfg, name, w, rate_list, time_scale, progress)
        except Exception as e:   # as in bench: keep the other configurations' results
            failed.append(f"{name}: {type(e).__name__}: {e}")
            continue
        lines += [append_jsonl(output, {**line, **extra}) for line in new]
    return lines, failed

"""Bench suites: the engine configurations `bench` and `latency-sweep` run, and the workloads they run on.

Engine settings resolve like every other command's (minillm.config_loader), lowest first: built-in defaults,
--config FILE (or, without it, the `engine` section of the suite file), --set, explicit flags, then what a
run/config entry of the suite names (so `--compare` still varies what it means to vary). The workload always
sets max_model_len, and a preset model name gets random `dummy` weights.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from minillm.config import ConfigError, EngineConfig
from minillm.package_data import shipped_dir

PRESET_DIR = Path(__file__).resolve().parents[1] / "presets"
BENCH_SUITE = shipped_dir("configs", "*.yaml") / "bench.yaml"
LATENCY_SUITE = shipped_dir("configs", "*.yaml") / "latency.yaml"

def read_suite(path: Path) -> dict:
    from minillm.config_loader import read_yaml_file
    data = read_yaml_file(path, "suite file") or {}
    if not isinstance(data, dict):
        raise ConfigError(f"suite file {path} must hold a mapping")
    return data


def _section_sets(engine: dict) -> list[str]:
    """The suite's sectioned engine mapping as `section.key=value` strings (JSON values are valid YAML)."""
    if not isinstance(engine, dict) or not all(isinstance(v, dict) for v in engine.values()):
        raise ConfigError("suite key 'engine' must map sections (model, cache, scheduler, runtime) to mappings")
    return [f"{section}.{key}={json.dumps(value)}" for section, body in engine.items() for key, value in body.items()]


def build_config(suite: dict, config: Path | None, sets: list[str], flags: dict, entry: dict,
                 max_model_len: int | None) -> EngineConfig:
    """One run's EngineConfig. config/sets/flags: the command's --config, --set and explicit engine flags
    (LLM keyword names, None = not given); entry: a run of the suite's list ({} for the base engine);
    max_model_len: the workload's (None: the model's own)."""
    from minillm.config_loader import load_config

    if flags.get("max_model_len") is not None:
        raise ConfigError("--max-model-len: the workload sets max_model_len (2048 offline, 8192 online); "
                          "use --workload FILE.yaml for another")
    base = [] if config else _section_sets(suite.get("engine", {}))
    overrides = {str(k): v for k, v in entry.items() if k != "name"}
    cfg, _ = load_config(config, [*base, *sets], **{**flags, **overrides, "max_model_len": max_model_len})
    model = cfg.model.model
    if model and not Path(model).is_dir() and (PRESET_DIR / f"{model}.json").is_file() \
            and cfg.model.load_format == "auto":
        cfg = EngineConfig.from_kwargs(base=cfg, load_format="dummy")
    return cfg


def fit_workload(w, suite: dict, config: Path | None, sets: list[str], flags: dict, entry: dict):
    """(the workload fitted to the model this run loads, its EngineConfig, notes on what fitting changed).
    The demo model, for one, has a 4,096-token vocabulary and 2,048 positions: the reference workloads draw ids
    up to 10,000 and the online one needs 8,192 positions."""
    from minillm.model.loader import resolve_arch

    probe = build_config(suite, config, sets, flags, entry, None)
    arch = resolve_arch(probe.model.model, probe.model.load_format)
    fitted, notes = w.fit(arch.vocab_size, arch.max_position_embeddings)
    return fitted, build_config(suite, config, sets, flags, entry, fitted.max_model_len), notes


def label(cfg: EngineConfig) -> str:
    s, r = cfg.scheduler, cfg.runtime
    parts = [f"{'chunked' if s.enable_chunked_prefill else 'prefill-first'}-{s.max_num_batched_tokens}"]
    parts += [s.policy] if s.policy != "fcfs" else []
    parts += [r.attention] if r.attention != "auto" else []
    parts += [r.attention_mode] if r.attention_mode != "split" else []
    parts += ["eager"] if r.enforce_eager else []
    return "+".join(parts)


def device_of(cfg: EngineConfig) -> str:
    import torch

    if cfg.runtime.device != "auto":
        return cfg.runtime.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def prepare_device(device: str) -> dict:
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


def offline_workload(workload: Path | None, num_requests: int | None):
    from minillm.bench.workloads import check_reference_totals, load_workload, reference_offline

    if workload is None:
        w = reference_offline()
        check_reference_totals(w)   # before any timing: a drifted generator makes every figure incomparable
    else:
        w = load_workload(workload)
    return w.head(num_requests)


def online_workload(data: dict, workload: Path | None, num_requests: int | None):
    from minillm.bench.workloads import load_workload, online_workload as reference_online

    if workload:
        w = load_workload(workload)
    else:
        settings = data.get("workload", {})
        if not isinstance(settings, dict):
            raise ConfigError("suite key 'workload' must be a mapping of online workload settings")
        try:
            w = reference_online(**{str(k): v for k, v in settings.items()})
        except TypeError as e:   # an unknown setting
            raise ConfigError(f"suite key 'workload': {e}") from None
    if w.unit_arrivals is None:
        raise ConfigError(f"workload {w.name!r} has no arrivals: latency-sweep needs kind: online")
    return w.head(num_requests)


def suite_rates(data: dict) -> list[float]:
    rates = data.get("rates", [])
    if not isinstance(rates, list):
        raise ConfigError(f"suite key 'rates' must be a list of request rates, got {rates!r:.60}")
    return parse_rates(",".join(map(str, rates)))


def parse_rates(rates: str) -> list[float]:
    try:
        values = [float(x) for x in rates.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(0 < v < float("inf") for v in values):
        raise ConfigError(f"--rates={rates!r} is not allowed: comma-separated request rates > 0, e.g. 4,8")
    return values


def pick_configs(entries, names: str | None) -> list[dict]:
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

"""Results files (one JSON object per line, appended) and the rich tables printed after a run."""
from __future__ import annotations

import json
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from minillm.fingerprint import stamp

# Every results line carries these keys; tests check the schema against them.
COMMON_KEYS = ("kind", "engine", "label", "config", "workload", "date", "commit", "fingerprint")
BENCH_KEYS = COMMON_KEYS + ("load_s", "warmup_s", "wall_s", "output_tok_s", "total_tok_s", "preemptions", "floor")
LATENCY_KEYS = COMMON_KEYS + ("rate", "budget", "chunked", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
                              "itl_max_s", "output_tok_s")


def append_jsonl(path: str | Path, line: dict) -> dict:
    """Stamp the line (date, commit, GPU fingerprint) and append it; returns the stamped line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    stamped = {**line, **stamp()}
    with path.open("a") as f:
        f.write(json.dumps(stamped) + "\n")
    return stamped


def read_jsonl(path: str | Path, kind: str | None = None) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"results file {str(path)!r} does not exist")
    lines = []
    for n, text in enumerate(path.read_text().splitlines(), 1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not a JSON line ({e.msg})") from None
        if kind is None or line.get("kind") == kind:
            lines.append(line)
    return lines


def _fmt(x, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if x is None else f"{x * scale:,.{digits}f}"


def _engine_desc(line: dict) -> str:
    if line["engine"] != "minillm":
        return f"{line['engine']} {line['config'].get('transformers', '')}".strip()
    sched, rt = line["config"]["scheduler"], line["config"]["runtime"]
    mode = "chunked" if sched["enable_chunked_prefill"] else "prefill-first"
    return (f"{sched['policy']} {mode} {sched['max_num_batched_tokens']} {rt['attention']}/{rt['attention_mode']}"
            f"{' eager' if rt['enforce_eager'] else ''}")


def _add_column(table: Table, header: str, first: bool) -> None:
    """Numbers never wrap; the label column takes what is left of 80 columns and folds a long label."""
    if first:
        table.add_column(header, justify="left", overflow="fold", ratio=1)
    else:
        table.add_column(header.replace(" ", "\n", 1), justify="right", no_wrap=True)


def bench_table(lines: list[dict]) -> Table:
    """Side by side, with each throughput as a ratio to the first line. Fits 80 columns: what each run's
    engine was and how long it took to load are in the caption, one line per run."""
    table = Table(title="minillm bench (offline)", box=box.SIMPLE_HEAD, title_justify="left", caption_justify="left",
                  pad_edge=False)
    for col in ("run", "reqs", "wall s", "out tok/s", "total tok/s", "% floor", "vs first", "preempt"):
        _add_column(table, col, first=col == "run")
    first = lines[0]["output_tok_s"] if lines else None
    notes = []
    for line in lines:
        frac = line["floor"]["fraction_of_floor"]
        table.add_row(line["label"], str(line["workload"]["num_requests"]), _fmt(line["wall_s"], digits=2),
                      _fmt(line["output_tok_s"], digits=0), _fmt(line["total_tok_s"], digits=0), _fmt(frac, 100),
                      _fmt(line["output_tok_s"] / first, digits=2) + "x",
                      "-" if line["preemptions"] is None else str(line["preemptions"]))
        notes.append(f"{line['label']}: {_engine_desc(line)}; load {_fmt(line['load_s'])} s, warm-up "
                     f"{_fmt(line['warmup_s'])} s")
    table.caption = "\n".join(notes)
    return table


def latency_table(lines: list[dict]) -> Table:
    table = Table(title="minillm latency-sweep (online, times in ms)", box=box.SIMPLE_HEAD, title_justify="left",
                  pad_edge=False)
    for col in ("config", "budget", "rate", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "ITL max", "out tok/s"):
        _add_column(table, col, first=col == "config")
    for line in lines:
        table.add_row(line["label"], str(line["budget"]), f"{line['rate']:g}", _fmt(line["ttft_p50_s"], 1e3),
                      _fmt(line["ttft_p99_s"], 1e3), _fmt(line["itl_p50_s"], 1e3), _fmt(line["itl_p99_s"], 1e3),
                      _fmt(line["itl_max_s"], 1e3), _fmt(line["output_tok_s"], digits=0))
    return table


def print_table(table: Table, console: Console | None = None) -> None:
    (console or Console()).print(table)

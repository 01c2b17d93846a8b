"""The latency-sweep figure: TTFT p99 and ITL max against the chunk budget, one line per arrival rate.

Prefill-first has no chunk budget, so it is drawn as a dashed horizontal reference per rate; chunked runs in
unified attention mode are single markers beside the split-mode line of the same rate.
"""
from __future__ import annotations

from pathlib import Path

PANELS = (("ttft_p99_s", "TTFT p99 (s)"), ("itl_max_s", "ITL max (s)"))


def _latest(lines: list[dict]) -> dict[tuple[str, float], dict]:
    """Last line per (config, rate): a results file that was appended to several times plots its newest run."""
    return {(line["label"], line["rate"]): line for line in lines if line.get("kind") == "latency"}


def _provenance(lines: list[dict]) -> str:
    """GPU, commits and dates of the plotted lines, so a figure never travels without where it was measured.
    Pass the lines actually drawn: a figure merged from several runs names every commit, newest first."""
    newest = max(lines, key=lambda ln: ln.get("date", ""))
    gpu = (newest.get("fingerprint") or {}).get("gpu") or "no GPU"
    by_date = sorted(lines, key=lambda ln: ln.get("date", ""), reverse=True)
    commits = list(dict.fromkeys(ln.get("commit", "?") for ln in by_date))
    days = sorted({ln.get("date", "?")[:10] for ln in lines})
    label = "commit" if len(commits) == 1 else "commits"
    return f"minillm latency-sweep on {gpu}, {label} {', '.join(commits)}, {' to '.join([days[0], days[-1]][:len(days)])}"


def plot_latency(lines: list[dict], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    latest = list(_latest(lines).values())
    if not latest:
        raise ValueError("no latency lines to plot (kind == 'latency')")
    rates = sorted({line["rate"] for line in latest})
    budgets = sorted({line["budget"] for line in latest if line["chunked"]})
    fig, axes = plt.subplots(1, len(PANELS), figsize=(11, 4.5))
    for ax, (key, title) in zip(axes, PANELS):
        for i, rate in enumerate(rates):
            color = f"C{i}"
            at_rate = [ln for ln in latest if ln["rate"] == rate and ln[key] is not None]
            split = sorted((ln for ln in at_rate if ln["chunked"] and ln.get("attention_mode") == "split"),
                           key=lambda ln: ln["budget"])
            if split:
                ax.plot([ln["budget"] for ln in split], [ln[key] for ln in split], "o-", color=color,
                        label=f"{rate:g} req/s chunked")
            for ln in at_rate:
                if not ln["chunked"]:
                    ax.axhline(ln[key], color=color, linestyle="--", label=f"{rate:g} req/s prefill-first")
                elif ln.get("attention_mode") == "unified":
                    ax.plot([ln["budget"]], [ln[key]], "x", color=color, markersize=10,
                            label=f"{rate:g} req/s unified")
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_yscale("log")
        ax.set_xlabel("chunk budget (max_num_batched_tokens)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(_provenance(latest), fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

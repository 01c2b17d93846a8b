"""Progress on stderr for long runs (generate, bench, latency-sweep).

On a terminal it is a rich progress bar. When stderr is a file or a pipe (a log, CI, `2> run.log`) a bar
cannot redraw itself, so a plain line is printed instead every PLAIN_EVERY_S seconds and once at the end.
"""
from __future__ import annotations

import sys
import time

PLAIN_EVERY_S = 10.0


def stderr_is_terminal() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):   # closed or replaced stderr
        return False


class PlainProgress:
    """The part of rich.progress.Progress that the bench uses (add_task, update), as timed plain lines."""

    def __init__(self, every_s: float | None = None, stream=None):
        self.every_s = PLAIN_EVERY_S if every_s is None else every_s
        self.stream = stream
        self.tasks: dict[int, dict] = {}

    def __enter__(self) -> "PlainProgress":
        return self

    def __exit__(self, *exc) -> bool:
        for task in self.tasks.values():
            if task["shown"] != (task["completed"], task["tokens"]):
                self._print(task)
        return False

    def add_task(self, description: str, total: int, tokens: int = 0) -> int:
        now = time.perf_counter()
        task_id = len(self.tasks)
        self.tasks[task_id] = {"description": description, "total": total, "completed": 0, "tokens": tokens,
                               "start": now, "last": now, "shown": (0, tokens)}
        return task_id

    def update(self, task_id: int, completed: int | None = None, tokens: int | None = None, advance: int = 0,
               **_) -> None:
        task = self.tasks[task_id]
        task["completed"] = task["completed"] + advance if completed is None else completed
        if tokens is not None:
            task["tokens"] = tokens
        now = time.perf_counter()
        if now - task["last"] >= self.every_s:
            task["last"] = now
            self._print(task)

    def _print(self, task: dict) -> None:
        elapsed = time.perf_counter() - task["start"]
        rate = task["tokens"] / elapsed if elapsed > 0 else 0.0
        total = "?" if task["total"] is None else task["total"]   # a streamed input has no count up front
        line = (f"{task['description']}: {task['completed']}/{total} requests, {task['tokens']:,} output "
                f"tokens, {elapsed:,.0f} s ({rate:,.1f} tok/s)")
        try:
            print(line, file=self.stream or sys.stderr, flush=True)
        except (OSError, ValueError):   # stderr went away: progress is not worth failing for
            pass
        task["shown"] = (task["completed"], task["tokens"])


def progress_bar(enabled: bool, transient: bool = True):
    """A progress display with add_task(description, total, tokens=) and update(task, completed=, tokens=):
    a rich bar on a terminal, timed plain lines otherwise, None when disabled (callers check `if bar`)."""
    from contextlib import nullcontext
    if not enabled:
        return nullcontext(None)
    if not stderr_is_terminal():
        return PlainProgress()
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[tokens]} tok"), TimeElapsedColumn(), transient=transient,
                    console=Console(stderr=True))


class TokenProgress:
    """`with TokenProgress(total, enabled, label) as advance:` then `advance(n_tokens)` once per finished
    request. Disabled, it is a no-op, so callers need no branches."""

    def __init__(self, total: int, enabled: bool, label: str = "generate", transient: bool = False):
        self.total, self.enabled, self.label, self.transient = total, enabled, label, transient
        self.tokens = 0

    def __enter__(self):
        if not self.enabled:
            return lambda n_tokens: None
        if not stderr_is_terminal():
            self.bar = PlainProgress()
            self.task = self.bar.add_task(self.label, total=self.total)
            return self._advance_plain
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        self.bar = Progress(TextColumn(self.label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            TextColumn("{task.fields[rate]}"), console=Console(stderr=True),
                            transient=self.transient)
        self.bar.__enter__()
        self.task = self.bar.add_task(self.label, total=self.total, rate="")
        return self._advance

    def _advance(self, n_tokens: int) -> None:
        self.tokens += n_tokens
        elapsed = self.bar.tasks[0].elapsed or 1e-9
        self.bar.update(self.task, advance=1, rate=f"{self.tokens / elapsed:,.1f} out tok/s")

    def _advance_plain(self, n_tokens: int) -> None:
        self.tokens += n_tokens
        self.bar.update(self.task, advance=1, tokens=self.tokens)

    def __exit__(self, *exc):
        if self.enabled and not isinstance(self.bar, PlainProgress):
            self.bar.__exit__(*exc)
        return False

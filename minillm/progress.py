"""One progress bar for long generate runs: requests done and output tokens/s, on stderr (rich)."""
from __future__ import annotations


class TokenProgress:
    """`with TokenProgress(total, enabled, label) as advance:` then `advance(n_tokens)` once per finished
    request. Disabled, it is a no-op, so callers need no branches."""

    def __init__(self, total: int, enabled: bool, label: str = "generate", transient: bool = False):
        self.total, self.enabled, self.label, self.transient = total, enabled, label, transient
        self.tokens = 0

    def __enter__(self):
        if not self.enabled:
            return lambda n_tokens: None
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

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.__exit__(*exc)
        return False

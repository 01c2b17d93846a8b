"""Progress when stderr is not a terminal: timed plain lines instead of a bar that cannot redraw."""
import io

from minillm import progress
from minillm.progress import PlainProgress, TokenProgress


def test_plain_progress_prints_timed_lines_and_a_last_one():
    out = io.StringIO()
    with PlainProgress(every_s=0.0, stream=out) as bar:
        task = bar.add_task("offline", total=4)
        bar.update(task, completed=1, tokens=100)
        bar.update(task, completed=3, tokens=250)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("offline: 1/4 requests, 100 output tokens")
    assert lines[1].startswith("offline: 3/4 requests, 250 output tokens") and len(lines) == 2


def test_plain_progress_stays_quiet_between_intervals():
    out = io.StringIO()
    with PlainProgress(every_s=3600.0, stream=out) as bar:
        task = bar.add_task("x", total=10)
        for i in range(10):
            bar.update(task, completed=i + 1, tokens=i)
    assert out.getvalue().splitlines() == [out.getvalue().splitlines()[-1]]   # only the closing line
    assert "10/10 requests" in out.getvalue()


def test_generate_progress_off_a_terminal_prints_lines(capsys, monkeypatch):
    monkeypatch.setattr(progress, "PLAIN_EVERY_S", 0.0)
    monkeypatch.setattr(progress, "stderr_is_terminal", lambda: False)
    with TokenProgress(3, True) as advance:
        for n in (5, 7, 9):
            advance(n)
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("generate: 3/3 requests, 21 output tokens")

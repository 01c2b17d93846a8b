"""`generate` streams: bounded admission, answers before the input ends, in order; its -o file is never the input,
and is replaced whole at the end (a concurrent run writing the same file is refused)."""
import fcntl
import io
import json
import os
import subprocess
import sys
import threading

import pytest

from minillm.serve.generate_jsonl import run_generate

DEFAULTS = {"temperature": 0.0, "max_tokens": 2}


@pytest.fixture(scope="module")
def llm():
    from minillm import LLM
    return LLM(device="cpu", max_num_seqs=4, max_model_len=128, num_kv_blocks=64)


class CountingLLM:
    """The LLM, counting the requests it holds at once."""

    def __init__(self, llm):
        self.llm, self.config, self.live, self.most = llm, llm.config, set(), 0

    def add_request(self, *args, request_id, **kw):
        self.live.add(request_id)
        self.most = max(self.most, len(self.live))
        return self.llm.add_request(*args, request_id=request_id, **kw)

    def step(self):
        outputs = self.llm.step()
        self.live -= {so.request_id for so in outputs if so.output is not None}
        return outputs

    def abort(self, rid):
        return self.llm.abort(rid)

    def has_unfinished_requests(self):
        return self.llm.has_unfinished_requests()


def _lines(n: int):
    return [(i, json.dumps({"id": i, "prompt": "Open the file", "max_tokens": 1 + i % 3}).encode())
            for i in range(1, n + 1)]


def test_admission_is_bounded_by_the_window_and_answers_keep_input_order(llm):
    counting, out = CountingLLM(llm), io.BytesIO()
    summary = run_generate(counting, iter(_lines(40)), DEFAULTS, out, progress=False, window=5)
    got = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [a["id"] for a in got] == list(range(1, 41)) and summary.ok == 40
    assert [len(a["token_ids"]) for a in got] == [1 + i % 3 for i in range(1, 41)]
    assert 1 <= counting.most <= 5


def test_first_answer_is_written_before_the_input_ends(llm):
    """The input holds back its second line until the first answer is out (or 30 s pass)."""
    class Out(io.BytesIO):
        answered = threading.Event()

        def write(self, b):
            n = super().write(b)
            self.answered.set()
            return n

    out = Out()
    seen_before_end = []

    def lines():
        yield _lines(1)[0]
        seen_before_end.append(out.answered.wait(30))
        yield (2, b'{"id": 2, "prompt_token_ids": [5, 6]}')

    run_generate(llm, lines(), DEFAULTS, out, progress=False)
    assert seen_before_end == [True]
    assert [json.loads(line)["id"] for line in out.getvalue().splitlines()] == [1, 2]


def test_a_failing_input_is_answered_and_the_lines_before_it_kept(llm):
    def lines():
        yield _lines(1)[0]
        raise OSError(5, "Input/output error")

    out = io.BytesIO()
    summary = run_generate(llm, lines(), DEFAULTS, out, progress=False)
    got = [json.loads(line) for line in out.getvalue().splitlines()]
    assert got[0]["id"] == 1 and "error" not in got[0]
    assert got[1]["error"]["type"] == "read_error" and "Input/output error" in got[1]["error"]["message"]
    assert summary.exit_code == 1


# ---------------------------------------------------------------- the CLI's input and output files

def _cli(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minillm", "generate", *map(str, args), "--device", "cpu",
                           "--no-progress", "--set", "sampling.max_tokens=2"], capture_output=True, timeout=120,
                          **kw)


def test_output_that_is_the_input_is_refused(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"prompt": "hi"}\n')
    os.symlink(path, tmp_path / "link.jsonl")
    for out in (path, tmp_path / "link.jsonl", tmp_path / "." / "x.jsonl"):
        r = _cli(path, "-o", out)
        assert r.returncode == 2 and b"is the input file" in r.stderr and b"Traceback" not in r.stderr
    with path.open("rb") as stdin:
        r = _cli("-", "-o", path, stdin=stdin)
    assert r.returncode == 2 and b"is the input file" in r.stderr
    assert path.read_bytes() == b'{"prompt": "hi"}\n'


def test_output_being_written_by_another_run_is_refused_and_left_alone(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(b'{"prompt": "hi"}\n')
    out.write_bytes(b"the other run's answers\n")
    with out.open("rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)   # what a run writing out.jsonl holds
        r = _cli(inp, "-o", out)
    assert r.returncode == 2 and b"being written by another run" in r.stderr
    assert out.read_bytes() == b"the other run's answers\n"
    r = _cli(inp, "-o", out)
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_bytes())["id"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]   # no temporary left


@pytest.mark.slow
def test_concurrent_runs_with_one_output_lose_nothing_silently(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(b"".join(b'{"id": %d, "prompt": "Open"}\n' % i for i in range(20)))
    cmd = [sys.executable, "-m", "minillm", "generate", str(inp), "-o", str(out), "--device", "cpu", "--no-progress",
           "--set", "sampling.max_tokens=200", "--set", "sampling.ignore_eos=true"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(3)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    ok = [code for code, _ in results if code == 0]
    refused = [err for code, err in results if code == 2]
    assert len(ok) + len(refused) == 3 and ok, results
    assert all(b"being written by another run" in err for err in refused)
    # every run that exited 0 wrote a whole file of answers: the one there is complete
    assert [json.loads(line)["id"] for line in out.read_bytes().splitlines()] == list(range(20))


def test_output_through_a_symlink_replaces_its_target(tmp_path):
    inp, target, link = tmp_path / "in.jsonl", tmp_path / "real.jsonl", tmp_path / "link.jsonl"
    inp.write_bytes(b'{"prompt": "hi"}\n')
    target.write_bytes(b"old\n")
    os.symlink(target, link)
    r = _cli(inp, "-o", link)
    assert r.returncode == 0, r.stderr
    assert link.is_symlink() and json.loads(target.read_bytes())["id"] == 1

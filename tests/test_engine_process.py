"""The engine core in its own process (parallel.engine_process) and data-parallel replicas of it.

Same tokens as in-process; the front end's death ends the engine process; the engine process's death ends every
open HTTP stream with an error chunk and [DONE] and the server with a non-zero exit; start/stop in a loop leaves
no process and no socket directory; DP=2 answers every request once, in order, and a killed replica gives a clean
error. Every test here spawns processes (a few seconds each on the CPU), so they are marked slow.
"""
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import httpx
import pytest

from http_server import REPO, ServerProcess
from minillm import LLM, SamplingParams
from minillm.engine.core_client import EngineDeadError, RequestsFailed

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = ["hello world", "abc", "the quick brown fox", "x", "one two three four", "zz"]


def _children(pid: int) -> list[int]:
    """Live engine-core children of `pid` (multiprocessing's spawned processes, not its resource tracker)."""
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(stat[:-4] + "cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and b"spawn_main" in cmd:
            out.append(int(stat.split("/")[2]))
    return out


def _ipc_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "minillm-ipc-*")))


def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture(scope="module")
def reference():
    return [o.token_ids for o in LLM(device="cpu").generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_engine_process_matches_in_process_and_start_stop_leaks_nothing(reference):
    before = _ipc_dirs()
    for _ in range(2):
        with LLM(device="cpu", engine_process=True) as llm:
            assert len(_children(os.getpid())) == 1
            out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            assert [o.token_ids for o in out] == reference
            two = llm.generate("hello", SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=1, ignore_eos=True),
                               use_tqdm=False)
            assert len(two[0].outputs) == 2 and all(len(c.token_ids) == 4 for c in two[0].outputs)
            rid = llm.add_request("abc", SamplingParams(max_tokens=400, ignore_eos=True))
            llm.step()
            assert llm.abort(rid)
            finals = [o for _ in range(50) for o in llm.step() if o.finished]
            assert [o.finish_reason for o in finals] == ["abort"] and not llm.has_unfinished_requests()
            with pytest.raises(ValueError, match="max_model_len"):
                llm.add_request([1, 2], SamplingParams(max_tokens=10**6))
        assert _children(os.getpid()) == []
    assert _ipc_dirs() == before


def test_data_parallel_answers_every_request_once_in_order(reference):
    with LLM(device="cpu", data_parallel_size=2) as llm:
        assert len(_children(os.getpid())) == 2
        out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in out] == reference
        balancer = llm.engine.core._balancer
        assert all(r == 0 for r in balancer.reported)   # both idle again, and told the front end so
        assert llm.stats().num_running == 0
    assert _children(os.getpid()) == []


def test_killed_replica_fails_its_requests_and_the_other_serves_on(reference):
    with LLM(device="cpu", data_parallel_size=2) as llm:
        victim = llm.engine.core._procs[1].pid
        threading.Timer(1.0, os.kill, (victim, signal.SIGKILL)).start()
        with pytest.raises(RequestsFailed, match="engine core process 1 exited") as failed:
            llm.generate(["a"] * 4, SamplingParams(max_tokens=2000, ignore_eos=True), use_tqdm=False)
        assert len(failed.value.request_ids) == 2   # the two that went to replica 1
        out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)   # replica 0 takes everything now
        assert [o.token_ids for o in out] == reference
        assert llm.engine.core._balancer.alive == [True, False]
        victim0 = llm.engine.core._procs[0].pid
        os.kill(victim0, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="engine core process 0 exited"):
            llm.generate(["b"], SamplingParams(max_tokens=2000, ignore_eos=True), use_tqdm=False)
        with pytest.raises(EngineDeadError):
            llm.add_request("b", GREEDY)
    assert _children(os.getpid()) == []


def test_engine_process_exits_when_the_front_end_dies():
    script = textwrap.dedent("""
        import os, sys, time
        from minillm import LLM
        if __name__ == "__main__":
            llm = LLM(device="cpu", engine_process=True)
            print(llm.engine.core._procs[0].pid, flush=True)
            time.sleep(600)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    front = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        core_pid = int(front.stdout.readline())
        front.kill()
        front.wait(10)
        assert _wait(lambda: not os.path.exists(f"/proc/{core_pid}") or _zombie(core_pid), 10.0)
    finally:
        if front.poll() is None:
            front.kill()


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _stream(url: str, results: dict, key: int, started: threading.Event, max_tokens: int = 2000) -> None:
    body = {"prompt": "x", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    lines = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
                started.set()
    results[key] = lines


def test_engine_process_killed_mid_stream_ends_every_stream_and_the_server():
    srv = ServerProcess("--set", "parallel.engine_process=true")
    try:
        (core_pid,) = _children(srv.proc.pid)
        results, threads = {}, []
        for i in range(3):
            started = threading.Event()
            t = threading.Thread(target=_stream, args=(srv.url, results, i, started), daemon=True)
            t.start()
            assert started.wait(30)
            threads.append(t)
        os.kill(core_pid, signal.SIGKILL)
        for t in threads:
            t.join(15)
        assert sorted(results) == [0, 1, 2]
        for lines in results.values():
            assert lines[-1] == "data: [DONE]"
            error = json.loads(lines[-2][len("data: "):])
            assert "engine core process 0 exited" in error["error"]["message"]
        assert srv.proc.wait(15) == 1
        assert any("every request in flight got an error" in line for line in srv.stderr)
    finally:
        srv.kill()


def test_serve_with_two_replicas_answers_all_and_survives_one_killed():
    srv = ServerProcess("--dp", "2", "--drain-timeout", "2")
    try:
        replicas = _children(srv.proc.pid)
        assert len(replicas) == 2
        bodies = [{"prompt": p, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True} for p in PROMPTS]
        with httpx.Client(timeout=60) as client:
            results = [client.post(srv.url + "/v1/completions", json=b) for b in bodies]
        assert all(r.status_code == 200 for r in results)
        assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in results)
        metrics = srv.metrics()
        assert 'minillm_replica_running{replica="1"}' in metrics
        assert metrics['minillm_requests_finished_total{finish_reason="length"}'] == len(PROMPTS)
        # Four long streams spread over both replicas; kill one: its streams end with an error, the others finish.
        results, threads = {}, []
        for i in range(4):
            started = threading.Event()
            t = threading.Thread(target=_stream, args=(srv.url, results, i, started, 400), daemon=True)
            t.start()
            threads.append((t, started))
        assert all(started.wait(30) for _, started in threads)
        busy = lambda: [srv.metrics()[f'minillm_replica_running{{replica="{i}"}}'] for i in (0, 1)]  # noqa: E731
        assert _wait(lambda: min(busy()) >= 1, 10), busy()   # least-loaded: both replicas got streams
        os.kill(replicas[0], signal.SIGKILL)
        for t, _ in threads:
            t.join(90)
        assert sorted(results) == [0, 1, 2, 3] and all(lines[-1] == "data: [DONE]" for lines in results.values())
        errored = [k for k, lines in results.items() if "engine core process" in lines[-2]]
        finished = [k for k, lines in results.items() if '"finish_reason":"length"' in lines[-2]]
        assert errored and finished and len(errored) + len(finished) == 4, results
        assert httpx.get(srv.url + "/health").status_code == 200
        r = httpx.post(srv.url + "/v1/completions", json=bodies[0], timeout=60)
        assert r.status_code == 200
        assert srv.terminate(30) == 0
    finally:
        srv.kill()


def test_the_core_loops_exit_line_becomes_a_results_line(tmp_path):
    """The core's exit summary (step time by phase and path) is JSON after EXIT_LINE, and http_latency.py files
    it beside the latency rows."""
    import importlib.util

    from minillm.engine.core_process import EXIT_LINE, LoopTimes

    times = LoopTimes()
    times.profile.count_step(3, True)
    times.profile.count_path("graph")
    times.add(0.002, 0.0001)
    log = tmp_path / "serve.log"
    log.write_text(f"ready\n{EXIT_LINE}0: {json.dumps(times.summary())}\n")
    spec = importlib.util.spec_from_file_location("http_latency", REPO / "scripts" / "http_latency.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "latency.jsonl"
    script._append_core_loops(log, out, "process")
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["kind"] == "engine_core_loop" and row["replica"] == 0 and row["paths"] == {"graph": 1}
    assert row["steps"] == 1 and abs(row["step_ms"] - 2.0) < 1e-9 and set(row["phase_ms"]) >= {"schedule", "update"}

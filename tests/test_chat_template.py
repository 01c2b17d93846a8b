"""Hostile chat templates: a render that loops, grows its output or its memory is stopped in its worker process
with a ValueError naming why, and the next render works (the worker is replaced)."""
import json
import shutil
import signal
import subprocess
import sys
import time

import pytest

from minillm.chat_template import TemplateRenderer
from minillm.model.loader import DEMO_MODEL_DIR

LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
EMIT = "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx{% endfor %}{% endfor %}"
HOARD = "{% set x = 'a' * 10000000000 %}{{ x[:3] }}"
MACRO = "{% macro m() %}{% for i in range(100000) %}{% for j in range(100000) %}xx{% endfor %}{% endfor %}" \
        "{% endmacro %}{{ m()[:3] }}"
OK = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
VARS = {"messages": [{"role": "user", "content": "hi"}]}


def _refused(template: str, words: str, **kw) -> float:
    renderer = TemplateRenderer(template, timeout_s=1.0, memory_bytes=512 << 20)
    start = time.monotonic()
    with pytest.raises(ValueError, match=words):
        renderer.render(VARS, **kw)
    took = time.monotonic() - start
    renderer.close()
    return took


def test_a_looping_template_is_stopped_at_its_time_limit():
    assert _refused(LOOP, r"chat template failed on these messages: rendering took longer than 1 s",
                    max_chars=1000) < 10


def test_a_template_that_emits_without_end_is_cut_at_max_chars():
    _refused(EMIT, "its output is longer than 10,000 characters", max_chars=10_000)


@pytest.mark.parametrize("template", [HOARD, MACRO])
def test_a_template_that_hoards_memory_is_stopped(template):
    _refused(template, "ran out of the memory|took longer than|process ended", max_chars=1000)


def test_the_worker_is_replaced_after_a_kill_and_errors_are_named():
    renderer = TemplateRenderer(LOOP, timeout_s=1.0)
    with pytest.raises(ValueError):
        renderer.render(VARS, max_chars=100)
    renderer.template = OK   # the same renderer, a fresh worker: a kill leaves nothing behind
    assert renderer.render(VARS, max_chars=100) == "<user>hi"
    renderer.close()
    bad = TemplateRenderer("{{ raise_exception('no system role') }}")
    with pytest.raises(ValueError, match="chat template failed on these messages: no system role"):
        bad.render(VARS, max_chars=100)
    bad.close()


@pytest.mark.slow
def test_generate_with_a_looping_template_answers_and_honours_sigterm(tmp_path):
    """Ten chat lines whose template loops (5 s each to be refused), then a plain one: SIGTERM during the
    renders ends the run within one render's limit, every line answered."""
    model = tmp_path / "model"
    shutil.copytree(DEMO_MODEL_DIR, model)
    (model / "chat_template.jinja").write_text(LOOP)
    lines = [json.dumps({"id": i, "messages": [{"role": "user", "content": "hi"}]}) for i in range(10)]
    (tmp_path / "in.jsonl").write_text("\n".join([*lines, json.dumps({"id": "plain", "prompt": "Open"})]) + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "minillm", "generate", str(tmp_path / "in.jsonl"), "--model",
                             str(model), "--device", "cpu", "--no-progress", "--set", "sampling.max_tokens=2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
    try:
        first = json.loads(proc.stdout.readline())   # one render has run into its limit
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - signalled
    finally:
        proc.kill()
    got = [first, *(json.loads(line) for line in out.splitlines())]
    assert proc.returncode == 143 and took < 15, (took, err.decode())
    assert [a["id"] for a in got] == [*range(10), "plain"]
    assert "took longer than 5 s" in first["error"]["message"]
    assert got[-1]["error"]["type"] == "interrupted" and b"Traceback" not in err

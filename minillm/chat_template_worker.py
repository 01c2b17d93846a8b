"""Chat-template rendering in a worker process: bounded in time, memory and output, whatever the template does.

A model directory's chat template is code from outside (jinja), and a request's messages are its input. A
template can loop for hours (`range(100000)` nested), or grow its output until the machine runs out of memory.
Jinja's sandbox stops attribute tricks but not loops or big strings, and a thread cannot be stopped, so the
template runs here, in a separate process that

  - renders as a stream and stops once the output passes the caller's character cap;
  - lives under an address-space limit (RLIMIT_AS: a fresh interpreter with jinja2 is ~30 MB, so the limit
    bounds what a template can allocate, and a MemoryError is answered like any other failure);
  - is killed by the parent when a render takes longer than its time limit, and replaced on the next render.

It imports only the standard library and jinja2 (it runs as a script), ignores SIGINT and SIGTERM (the parent
decides when it ends), and exits when its parent goes away. Protocol: JSON lines on stdin/stdout; first the
template (answered by {"ready"} once compiled), then one {"variables", "max_chars"} per render, answered by
{"text"} or {"error"}.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox


def environment() -> jinja2.Environment:
    """The environment HF chat templates expect: trimmed blocks, loop controls, tojson, raise_exception."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Templates embed tool schemas etc. verbatim: keep non-ASCII text readable, as HF's chat templating does.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def render(template: jinja2.Template, variables: dict, max_chars: int) -> dict:
    """One render as the answer line: {"text"} or {"error"}."""
    parts, size = [], 0
    try:
        for chunk in template.generate(**variables):
            size += len(chunk)
            if size > max_chars:
                return {"error": f"its output is longer than {max_chars:,} characters"}
            parts.append(chunk)
        return {"text": "".join(parts)}
    except MemoryError:
        parts.clear()
        return {"error": "it ran out of the memory a chat template may use"}
    except jinja2.TemplateError as e:
        return {"error": str(e)}
    except Exception as e:  # noqa: BLE001 - a template may fail in any way; the worker must answer and go on
        return {"error": f"{type(e).__name__}: {e}"}


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    memory = int(sys.argv[1])
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    lines = sys.stdin.buffer
    template = environment().from_string(json.loads(lines.readline())["template"])
    out = sys.stdout.buffer
    out.write(b'{"ready": true}\n')   # the parent's time limit for a render starts from here
    out.flush()
    for line in lines:
        job = json.loads(line)
        answer = render(template, job["variables"], job["max_chars"])
        out.write(json.dumps(answer).encode("ascii") + b"\n")
        out.flush()


if __name__ == "__main__":
    main()

"""The parent side of chat-template rendering: a few worker processes (minillm/chat_template_worker.py), each
started on first need, killed when a render runs past its time limit, and replaced by a fresh one.

Why processes: a template's loops and string growth cannot be bounded from inside jinja (the sandbox counts
neither), and a thread that runs one cannot be stopped; a process can be killed, and its memory limited, without
touching the server or the engine. A render costs a pipe round trip (well under a millisecond for a chat);
the first one also pays for starting the interpreter.
"""
from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from minillm.limits import CHAT_TEMPLATE_MEMORY_BYTES, CHAT_TEMPLATE_TIMEOUT_S

_WORKER = Path(__file__).with_name("chat_template_worker.py")
MAX_WORKERS = 4           # renders at once; more callers wait for a worker
_START_TIMEOUT_S = 60.0   # starting an interpreter and importing jinja2, on a busy machine


class TemplateRenderer:
    def __init__(self, template: str, timeout_s: float = CHAT_TEMPLATE_TIMEOUT_S,
                 memory_bytes: int = CHAT_TEMPLATE_MEMORY_BYTES):
        self.template, self.timeout_s, self.memory_bytes = template, timeout_s, memory_bytes
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._slots = threading.BoundedSemaphore(MAX_WORKERS)

    def render(self, variables: dict, max_chars: int) -> str:
        """The rendered text, or ValueError saying why not (the template failed, ran too long, grew too big)."""
        with self._slots:
            worker = None
            try:
                worker = self._take()
                answer = worker.ask({"variables": variables, "max_chars": max_chars}, self.timeout_s)
            except _WorkerGone as e:
                if worker is not None:
                    worker.kill()
                raise ValueError(f"chat template failed on these messages: {e}") from None
            self._idle.put(worker)
        if "error" in answer:
            raise ValueError(f"chat template failed on these messages: {answer['error']}")
        return answer["text"]

    def _take(self) -> "_Worker":
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                return _Worker(self.template, self.memory_bytes)
            if worker.alive():
                return worker

    def close(self) -> None:
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                return


class _WorkerGone(Exception):
    pass


class _Worker:
    def __init__(self, template: str, memory_bytes: int):
        self.proc = subprocess.Popen([sys.executable, "-I", str(_WORKER), str(memory_bytes)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
        self._buf = bytearray()
        try:
            self._send({"template": template})
            self._read_line(_START_TIMEOUT_S, "starting the rendering process")
        except _WorkerGone:
            self.kill()
            raise

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _send(self, obj: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(obj).encode("ascii") + b"\n")
            self.proc.stdin.flush()
        except OSError as e:   # it died (a template that failed to compile exits at once)
            raise _WorkerGone(f"the rendering process ended ({e})") from None

    def ask(self, job: dict, timeout_s: float) -> dict:
        """Send one render and wait for its answer line, at most timeout_s."""
        self._send(job)
        return self._read_line(timeout_s, "rendering")

    def _read_line(self, timeout_s: float, what: str) -> dict:
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        end = self._buf.find(b"\n")
        while end < 0:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _WorkerGone(f"{what} took longer than {timeout_s:g} s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise _WorkerGone("the rendering process ended (out of memory, or a template that does not "
                                      "compile)")
                at = chunk.find(b"\n")
                end = -1 if at < 0 else len(self._buf) + at
                self._buf += chunk
        line = bytes(self._buf[:end])
        del self._buf[:end + 1]
        return json.loads(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass

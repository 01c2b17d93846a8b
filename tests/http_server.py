"""A real `minillm serve` subprocess for the HTTP tests (the demo model on the CPU, any free port).

It is started with --port 0 and the tests read the address from its "ready on" line, so parallel runs never race
for a port. A thread keeps reading its stderr, so a chatty server can never block on a full pipe.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
READY = re.compile(r"ready on (http://\S+)")


class ServerProcess:
    def __init__(self, *args: str, timeout: float = 120.0):
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-m", "minillm", "serve", "--port", "0", "--device", "cpu", "--log-level", "warning",
               *args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
        self.stderr: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        self._wait_ready(timeout)

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)
            m = READY.search(line)
            if m and self.url is None:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()   # EOF: the process ended (a failed start is reported by _wait_ready)

    def _wait_ready(self, timeout: float) -> None:
        if not self._ready.wait(timeout) or self.url is None:
            self.kill()
            raise RuntimeError("minillm serve did not start:\n" + "".join(self.stderr[-40:]))
        deadline = time.monotonic() + timeout
        while httpx.get(self.url + "/health").status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("/health never answered 200")
            time.sleep(0.05)

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def metrics(self) -> dict[str, float]:
        """/metrics as {sample (with its labels): value}."""
        text = httpx.get(self.url + "/metrics").text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def terminate(self, timeout: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.terminate(30)
            except subprocess.TimeoutExpired:
                self.kill()

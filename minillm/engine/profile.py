"""Host-side step profile: where each engine step's wall time goes (schedule, input build, forward launch,
sampling + the wait for the GPU, update). Off unless a caller attaches one (the bench does), because even
perf_counter calls cost something at 256 rows x 1,000 steps."""
from __future__ import annotations

import time
from collections import defaultdict

PHASES = ("schedule", "build", "forward", "sample_sync", "update")


class StepProfile:
    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.decode_only_steps = 0
        self.rows = 0
        self.paths: dict[str, int] = defaultdict(int)   # steps by how they ran: megakernel, graph, eager
        self.gpu_ms = 0.0     # summed device spans of the timed steps (add_gpu)
        self.gpu_steps = 0
        self._t = 0.0

    def start(self) -> None:
        self._t = time.perf_counter()

    def mark(self, phase: str) -> None:
        """Charge the time since the previous mark (or start) to `phase`."""
        now = time.perf_counter()
        self.totals[phase] += now - self._t
        self._t = now

    def count_step(self, num_seqs: int, decode_only: bool) -> None:
        self.steps += 1
        self.rows += num_seqs
        self.decode_only_steps += decode_only

    def count_path(self, path: str) -> None:
        self.paths[path] += 1

    def add_gpu(self, ms: float) -> None:
        """One step's device span: from when the stream reached the step's first launch to its tokens' copy. Set
        against the host's ms per step, it tells a step the GPU is slow on from one the GPU waits for."""
        self.gpu_ms += ms
        self.gpu_steps += 1

    def summary(self) -> dict:
        n = max(self.steps, 1)
        return {"steps": self.steps, "decode_only_steps": self.decode_only_steps,
                "mean_rows": self.rows / n, "paths": dict(self.paths),
                "ms_per_step": {p: 1e3 * self.totals[p] / n for p in PHASES},
                "gpu_ms_per_step": self.gpu_ms / self.gpu_steps if self.gpu_steps else None,
                "total_s": {p: self.totals[p] for p in PHASES}}

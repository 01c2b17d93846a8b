"""Server settings: the `minillm serve` flags that are not engine config, with their defaults."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 8 << 20   # 8 MiB: a 200k-token prompt as JSON token ids still fits
DEFAULT_MAX_WAITING = 1024         # requests queued, not yet running, before new ones get 503
DEFAULT_DRAIN_TIMEOUT_S = 30.0     # after SIGTERM/SIGINT: how long requests in flight may run on
DEFAULT_HEADER_TIMEOUT_S = 10.0    # a connection's request headers must be complete within this (slowloris)
RETRY_AFTER_S = 1                  # the Retry-After header of a 503


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_waiting: int = DEFAULT_MAX_WAITING
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S

    def validate(self) -> "ServerSettings":
        """Raise ValueError naming the flag and what is allowed."""
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port={self.port} is not allowed: 0..65535 (0 = any free port)")
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-bytes={self.max_body_bytes} is not allowed: an integer >= 1024")
        if self.max_waiting < 1:
            raise ValueError(f"--max-waiting={self.max_waiting} is not allowed: an integer >= 1")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"--drain-timeout={self.drain_timeout_s} is not allowed: seconds >= 0")
        if not 0 < self.header_timeout_s < 1e6:
            raise ValueError(f"header_timeout_s={self.header_timeout_s} is not allowed: seconds in (0, 1e6)")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")
        if not self.served_model_name:
            raise ValueError("--served-model-name must not be empty")
        return self

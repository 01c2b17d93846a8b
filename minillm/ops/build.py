"""Build and load the CUDA extension: every minillm/cuda/*.cu plus every minillm/cuda/*bindings.cpp, one shared library.

Built at first use with torch.utils.cpp_extension (ninja) into a cache folder keyed by a hash of all sources
and flags (default ~/.cache/minillm/ext/<hash>, or $MINILLM_EXT_DIR/<hash>), so an edit rebuilds and an
unchanged tree loads in milliseconds. The ops register themselves as torch custom ops under
torch.ops.minillm. MINI_ENGINE_OPS=0 turns the CUDA ops off (cuda_ops_available() is then False).
"""
from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from pathlib import Path

CUDA_DIR = Path(__file__).resolve().parents[1] / "cuda"   # shipped as package data
EXT_NAME = "minillm_ops"

NVCC_FLAGS = [
    "-O3",
    "-std=c++17",
    "--expt-relaxed-constexpr",
    "-lineinfo",
    "-gencode", "arch=compute_90a,code=sm_90a",
    "-gencode", "arch=compute_80,code=sm_80",
]
CXX_FLAGS = ["-O3", "-std=c++17"]


def extension_sources(cuda_dir: Path = CUDA_DIR) -> list[Path]:
    """Kernel sources and bindings files, sorted so the hash is stable."""
    return sorted(cuda_dir.glob("*.cu")) + sorted(cuda_dir.glob("*bindings.cpp"))


def source_hash(cuda_dir: Path = CUDA_DIR) -> str:
    """Hash of every source and header in cuda/ plus the build flags: the cache key of a build."""
    h = hashlib.sha256()
    files = sorted(p for p in cuda_dir.iterdir() if p.suffix in {".cu", ".cuh", ".h", ".cpp"})
    for p in files:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(" ".join(NVCC_FLAGS + CXX_FLAGS).encode())
    return h.hexdigest()[:16]


def build_dir(cuda_dir: Path = CUDA_DIR) -> Path:
    root = os.environ.get("MINILLM_EXT_DIR") or str(Path.home() / ".cache" / "minillm" / "ext")
    return Path(root) / source_hash(cuda_dir)


def ops_disabled() -> bool:
    return os.environ.get("MINI_ENGINE_OPS", "1").strip() == "0"


@lru_cache(maxsize=1)
def load_extension():
    """Build (if needed) and load the extension; returns the torch.ops.minillm namespace."""
    import torch
    from torch.utils.cpp_extension import load

    sources = extension_sources()
    if not sources:
        raise RuntimeError(f"no CUDA sources found in {CUDA_DIR}")
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    prebuilt = out / f"{EXT_NAME}.so"
    if prebuilt.exists():
        torch.ops.load_library(str(prebuilt))  # cached build: skip ninja's dependency scan entirely
        return torch.ops.minillm
    from rich.console import Console

    with Console(stderr=True).status(f"Compiling minillm CUDA ops ({len(sources)} sources) into {out} ..."):
        load(name=EXT_NAME, sources=[str(s) for s in sources], extra_cflags=CXX_FLAGS,
             extra_cuda_cflags=NVCC_FLAGS, extra_include_paths=[str(CUDA_DIR)], build_directory=str(out),
             is_python_module=False, verbose=False)
    return torch.ops.minillm


@lru_cache(maxsize=1)
def cuda_ops_available() -> bool:
    """True when a GPU is present, the ops are not disabled, and the extension builds and loads."""
    if ops_disabled():
        return False
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        load_extension()
    except Exception as exc:  # a failed build must not take the engine down: the torch path still works
        import warnings

        warnings.warn(f"minillm CUDA ops unavailable, using the torch path: {exc}", stacklevel=2)
        return False
    return True


class CudaOpSwitch:
    """Whether CUDA tensors go to torch.ops.minillm.<probe>: decided once, on first use (the extension is
    built then), or forced with set() for tests and A/B timings (None = decide again)."""

    def __init__(self, probe: str):
        self.probe = probe
        self.enabled: bool | None = None

    def set(self, enabled: bool | None) -> None:
        self.enabled = enabled

    def __call__(self, x) -> bool:
        if not x.is_cuda:
            return False
        if self.enabled is None:
            self.enabled = has_op(self.probe)
        return self.enabled


def has_op(name: str) -> bool:
    """True when torch.ops.minillm.<name> is there to call (extension built and loaded, ops enabled)."""
    if not cuda_ops_available():
        return False
    import torch

    return hasattr(torch.ops.minillm, name)


"""Build and load the CUDA extension: every cuda/*.cu plus every cuda/*bindings.cpp, one library.

The sources ship inside the package (package data), so an editable install, a plain `pip install .` and a wheel
all build the same kernels. They are compiled at first use with torch.utils.cpp_extension (ninja) into a cache
folder keyed by everything that makes a build incompatible: the sources and flags, the torch and CUDA versions,
the Python ABI and the GPU architecture (default ~/.cache/minillm/ext/<key>, or $MINILLM_EXT_DIR/<key>). An
unchanged setup loads the cached library in milliseconds; anything else builds anew instead of loading a library
made for another torch. Machine code for sm_90a and sm_80 is embedded, plus sm_80 PTX that the driver can
compile for newer GPUs. The ops register themselves as torch custom ops under torch.ops.minillm.

Every failure raises ExtensionError naming the cause and the fix; minillm/ops/choice.py decides whether that is
a warning (kernels.backend=auto) or a configuration error (kernels.backend=cuda).
"""
from __future__ import annotations

import hashlib
import os
import sys
from functools import lru_cache
from pathlib import Path

from minillm.package_data import shipped_dir

CUDA_DIR = shipped_dir("cuda", "*.cu")   # the top-level cuda/, installed as minillm/cuda
EXT_NAME = "minillm_ops"

NVCC_FLAGS = [
    "-O3",
    "-std=c++17",
    "--expt-relaxed-constexpr",
    "-lineinfo",
    "-gencode", "arch=compute_90a,code=sm_90a",
    "-gencode", "arch=compute_80,code=sm_80",
    "-gencode", "arch=compute_80,code=compute_80",   # PTX: forward compatibility with newer GPUs
]
CXX_FLAGS = ["-O3", "-std=c++17"]
SOURCE_SUFFIXES = {".cu", ".cuh", ".h", ".cpp"}


class ExtensionError(RuntimeError):
    """The CUDA kernels cannot be built or loaded; the message says why and how to fix it."""


def extension_sources(cuda_dir: Path = CUDA_DIR) -> list[Path]:
    """Kernel sources and bindings files, sorted so the hash is stable."""
    return sorted(cuda_dir.glob("*.cu")) + sorted(cuda_dir.glob("*bindings.cpp"))


def build_key(cuda_dir: Path = CUDA_DIR, *, torch_version: str, cuda_version: str | None, arch: str) -> str:
    """The cache key of a build: every source and header, the flags, torch, CUDA, the Python ABI, the GPU."""
    h = hashlib.sha256()
    for p in sorted(p for p in cuda_dir.iterdir() if p.suffix in SOURCE_SUFFIXES):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(" ".join(NVCC_FLAGS + CXX_FLAGS).encode())
    abi = f"{sys.implementation.cache_tag}{getattr(sys, 'abiflags', '')}"
    h.update(f"torch={torch_version} cuda={cuda_version} python={abi} arch={arch}".encode())
    return h.hexdigest()[:16]


def _current_key(device_index: int = 0) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    return build_key(torch_version=torch.__version__, cuda_version=torch.version.cuda, arch=f"sm_{major}{minor}")


def build_dir(key: str) -> Path:
    root = os.environ.get("MINILLM_EXT_DIR") or str(Path.home() / ".cache" / "minillm" / "ext")
    return Path(root) / key


@lru_cache(maxsize=1)
def load_extension():
    """Build (if needed) and load the extension; returns the torch.ops.minillm namespace. Raises ExtensionError."""
    import torch

    if not torch.cuda.is_available():
        raise ExtensionError("no CUDA GPU is visible to torch (torch.cuda.is_available() is False)")
    sources = extension_sources()
    if not sources:
        raise ExtensionError(f"the kernel sources are missing from the installed package ({CUDA_DIR} has no .cu "
                             "files): reinstall minillm from its source tree or a wheel built from it")
    out = build_dir(_current_key())
    library = out / f"{EXT_NAME}.so"
    if not library.exists():
        _build(sources, out)
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as e:
        raise ExtensionError(f"loading the built kernels from {library} failed ({e}); delete that folder to "
                             "rebuild them") from None
    return torch.ops.minillm


def _build(sources: list[Path], out: Path) -> None:
    from rich.console import Console
    from torch.utils.cpp_extension import load

    out.mkdir(parents=True, exist_ok=True)
    try:
        with Console(stderr=True).status(f"Compiling minillm CUDA ops ({len(sources)} sources) into {out} ..."):
            load(name=EXT_NAME, sources=[str(s) for s in sources], extra_cflags=CXX_FLAGS,
                 extra_cuda_cflags=NVCC_FLAGS, extra_include_paths=[str(CUDA_DIR)], build_directory=str(out),
                 is_python_module=False, verbose=False)
    except (OSError, RuntimeError, ImportError) as e:
        last = str(e).strip().splitlines()[-3:]
        raise ExtensionError("building the CUDA kernels failed: " + " | ".join(last) + f". The build needs nvcc "
                             f"and ninja matching torch's CUDA; its files are in {out}") from None

"""Where the files that ship with minillm lie: the CUDA sources (cuda/) and the configs (configs/).

Both sit at the top of the source tree and install as minillm/cuda and minillm/configs: pyproject.toml maps the
packages minillm.cuda -> cuda and minillm.configs -> configs. A wheel or plain install has them inside the package;
a source checkout (an editable install, or the tree on PYTHONPATH) beside it.
"""
from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def shipped_dir(name: str, pattern: str) -> Path:
    """The folder of minillm.<name>: inside the installed package where it holds files matching `pattern`, else
    beside the package in its source tree. Never a same-named folder of some other project (site-packages may
    hold an unrelated top-level `cuda` package), since the package's own copy is looked for first."""
    package = Path(str(files("minillm")))
    inside = package / name
    return inside if any(inside.glob(pattern)) else package.parent / name

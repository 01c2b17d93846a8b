"""Layers import only downward: minillm/ops/ wraps kernels and imports nothing from the model or the attention
backends (check-kernels' cases live in minillm/diagnostics/), and the sampler does not import the runner (it reads
rows through minillm.contract.SamplingRow). Every import counts, also those inside functions and under
TYPE_CHECKING."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "minillm"

FORBIDDEN = {
    "ops": ("minillm.model", "minillm.attention", "minillm.runner", "minillm.engine", "minillm.diagnostics"),
    "sampling": ("minillm.runner", "minillm.engine"),
    "attention": ("minillm.model", "minillm.runner", "minillm.engine"),
    "model": ("minillm.runner", "minillm.engine"),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def violations(package: str, forbidden: tuple[str, ...], root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted((root / package).rglob("*.py")):
        for line, mod in imported_modules(path):
            if any(mod == f or mod.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(root.parent)}:{line} imports {mod}")
    return bad


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layers_import_only_downward(package):
    assert (ROOT / package).is_dir()
    assert violations(package, FORBIDDEN[package]) == []


def test_the_check_finds_lazy_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "minillm" / "ops"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("def f():\n    from minillm.model.arch import X\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import minillm.attention\n")
    (pkg / "c.py").write_text("from minillm import model\nfrom minillm.ops import reference\n")
    found = violations("ops", FORBIDDEN["ops"], tmp_path / "minillm")
    assert [f.split(" imports ")[1] for f in found] == ["minillm.model.arch", "minillm.model.arch.X",
                                                        "minillm.attention", "minillm.model"]


def test_the_runner_copy_of_a_request_is_a_sampling_row():
    """CachedRequest has every attribute the SamplingRow protocol names (and can be weakly referenced)."""
    import weakref

    from minillm.contract import SamplingRow
    from minillm.runner.request_state import CachedRequest
    from minillm.sampling_params import SamplingParams

    row = CachedRequest("r", [1, 2, 3], SamplingParams(), frozenset({0}), [0])
    names = [n for n in dir(SamplingRow) if not n.startswith("_")] + list(SamplingRow.__annotations__)
    assert set(names) >= {"num_prompt_tokens", "num_output_tokens", "all_token_ids", "sampling_row"}
    for name in names:
        assert hasattr(row, name), name
    assert (row.num_prompt_tokens, row.num_output_tokens) == (3, 0)
    assert weakref.ref(row)() is row

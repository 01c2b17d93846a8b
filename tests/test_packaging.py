"""A plain (non-editable) install and a wheel carry what every command needs at run time: the CUDA kernel sources
(top-level cuda/, installed as minillm/cuda, built at first use on a GPU), the configs (top-level configs/,
installed as minillm/configs), the demo model and the presets. Installed into a fresh directory and run from
another one, so nothing can come from the source tree."""
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KERNEL_SUFFIXES = {".cu", ".cuh", ".h", ".cpp"}


def _pip(*args, cwd):
    out = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=300, cwd=cwd)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """`pip install --target DIR .` of this tree."""
    root = tmp_path_factory.mktemp("plain")
    _pip("install", "-q", "--no-deps", "--no-build-isolation", "--target", str(root / "site"), str(REPO), cwd=root)
    return root / "site"


def _run(site: Path, cwd: Path, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(site), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd),
           "OMP_NUM_THREADS": "1"}   # one thread: on a busy 2-core machine two spin against each other
    return subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_packages_listed_in_pyproject_are_the_tree():
    """pyproject.toml lists the packages by hand (the package-dir mapping of cuda/ and configs/ needs it): a new
    subpackage left out of the list would be missing from every wheel."""
    tomllib = pytest.importorskip("tomllib")
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    in_tree = {".".join(p.relative_to(REPO).parent.parts) for p in (REPO / "minillm").rglob("__init__.py")}
    data = {"minillm.presets", "minillm.demo_model"}
    mapped = set(cfg["package-dir"])
    assert mapped == {"minillm.cuda", "minillm.configs"}
    assert set(cfg["packages"]) == in_tree | data | mapped
    assert all((REPO / d).is_dir() for d in cfg["package-dir"].values())


def test_plain_install_ships_kernel_sources_configs_and_demo_model(site, tmp_path):
    probe = ("import json, minillm, minillm.ops.build as b; from minillm.model.loader import DEMO_MODEL_DIR, "
             "PRESET_DIR; from minillm.bench.suite import BENCH_SUITE, LATENCY_SUITE; "
             "print(json.dumps([minillm.__file__, str(b.CUDA_DIR), [p.name for p in b.extension_sources()], "
             "sorted(p.name for p in b.CUDA_DIR.iterdir()), sorted(p.name for p in DEMO_MODEL_DIR.iterdir()), "
             "sorted(p.name for p in PRESET_DIR.iterdir()), str(BENCH_SUITE), str(LATENCY_SUITE)]))")
    out = _run(site, tmp_path, "-c", probe, timeout=120)
    assert out.returncode == 0, out.stderr
    where, cuda_dir, sources, cuda_files, demo, presets, bench, latency = json.loads(out.stdout)
    assert where.startswith(str(site)) and cuda_dir == str(site / "minillm" / "cuda")
    repo_cuda = REPO / "cuda"
    assert sorted(sources) == sorted([p.name for p in repo_cuda.glob("*.cu")] +
                                     [p.name for p in repo_cuda.glob("*bindings.cpp")])
    assert cuda_files == sorted(p.name for p in repo_cuda.iterdir() if p.suffix in KERNEL_SUFFIXES)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(demo)
    assert presets
    assert (bench, latency) == (str(site / "minillm" / "configs" / "bench.yaml"),
                                str(site / "minillm" / "configs" / "latency.yaml"))


@pytest.mark.slow
def test_plain_install_runs_bench_and_latency_sweep_from_another_directory(site, tmp_path):
    # Default suites (the packaged configs), default output: a scratch folder of the working directory.
    out = _run(site, tmp_path, "-m", "minillm", "bench", "--model", "demo", "--num-requests", "2", "--no-progress")
    assert out.returncode == 0, out.stderr[-2000:]
    line = json.loads((tmp_path / "minillm-results" / "bench.jsonl").read_text())
    assert line["workload"]["num_requests"] == 2 and line["output_tok_s"] > 0
    out = _run(site, tmp_path, "-m", "minillm", "latency-sweep", "--model", "demo", "--num-requests", "2",
               "--rates", "8", "--configs", "chunked-512", "--time-scale", "0.01", "--no-progress")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(s) for s in (tmp_path / "minillm-results" / "latency.jsonl").read_text().splitlines()]
    assert [(r["label"], r["rate"], r["budget"]) for r in rows] == [("chunked-512", 8.0, 512)]
    assert rows[0]["workload"]["num_requests"] == 2 and (tmp_path / "minillm-results" / "latency.png").exists()


@pytest.mark.slow
def test_wheel_carries_kernel_sources_and_configs(tmp_path):
    _pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(REPO), cwd=tmp_path)
    (wheel,) = tmp_path.glob("minillm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    want_cuda = {f"minillm/cuda/{p.name}" for p in (REPO / "cuda").iterdir() if p.suffix in KERNEL_SUFFIXES}
    want_configs = {f"minillm/configs/{p.name}" for p in (REPO / "configs").glob("*.yaml")}
    assert want_cuda and want_cuda <= names
    assert {"minillm/configs/bench.yaml", "minillm/configs/latency.yaml"} <= want_configs <= names
    assert "minillm/demo_model/model.safetensors" in names and "minillm/ops/build.py" in names
    assert not any(n.startswith(("cuda/", "configs/")) for n in names)   # no stray top-level folders


def test_source_tree_finds_its_own_kernel_sources_and_configs():
    """Run from the checkout (the editable layout): the top-level cuda/ and configs/ beside the package."""
    from minillm.bench.suite import BENCH_SUITE
    from minillm.ops.build import CUDA_DIR
    from minillm.package_data import shipped_dir
    if not Path(__import__("minillm").__file__).resolve().is_relative_to(REPO):
        pytest.skip("minillm is imported from an install, not this checkout")
    assert CUDA_DIR == REPO / "cuda" and any(CUDA_DIR.glob("*.cu"))
    assert BENCH_SUITE == REPO / "configs" / "bench.yaml" and shipped_dir("configs", "*.yaml") == REPO / "configs"


def test_every_kernel_source_is_in_the_build_key_and_the_package_data():
    """A file of cuda/ with another suffix would be left out of the build cache key and of the wheels."""
    from minillm.ops.build import SOURCE_SUFFIXES
    tomllib = pytest.importorskip("tomllib")
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["minillm.cuda"]
    files = [p for p in (REPO / "cuda").iterdir() if p.is_file()]
    assert files and all(p.suffix in SOURCE_SUFFIXES for p in files), [p.name for p in files]
    assert {g.removeprefix("*") for g in globs} == SOURCE_SUFFIXES == KERNEL_SUFFIXES


@pytest.mark.slow
def test_editable_install_finds_the_top_level_sources_and_configs(tmp_path):
    """`pip install -e .` maps minillm.cuda and minillm.configs onto cuda/ and configs/ of the checkout."""
    prefix = tmp_path / "prefix"
    # --ignore-installed: without it pip first uninstalls the minillm of the environment running the tests (also
    # with --prefix), which breaks every later test that starts a script in a subprocess.
    _pip("install", "-q", "--no-deps", "--no-build-isolation", "--ignore-installed", "-e", str(REPO), "--prefix",
         str(prefix), cwd=tmp_path)
    (site_dir,) = prefix.glob("lib/python*/site-packages")
    deps = [p for p in sys.path if p.endswith("site-packages")]
    # -S: only this editable install's .pth runs (not one the current environment may hold); the dependencies
    # come after it as plain paths.
    probe = ("import site, sys; site.addsitedir(sys.argv[1]); sys.path += sys.argv[2:]; import minillm; "
             "import minillm.ops.build as b, minillm.bench.suite as s; "
             "print(minillm.__file__); print(b.CUDA_DIR); print(s.BENCH_SUITE)")
    out = subprocess.run([sys.executable, "-S", "-c", probe, str(site_dir), *deps], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    where, cuda_dir, bench = out.stdout.split()
    assert Path(where) == REPO / "minillm" / "__init__.py"
    assert (Path(cuda_dir), Path(bench)) == (REPO / "cuda", REPO / "configs" / "bench.yaml")

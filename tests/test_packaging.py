"""A plain (non-editable) install carries what the engine needs at run time: the CUDA kernel sources (built at
first use on a GPU), the demo model and the presets. Installed into a fresh directory and imported from there,
so nothing can come from the source tree."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_plain_install_ships_kernel_sources_and_demo_model(tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(site), str(REPO)], check=True, capture_output=True, timeout=300, cwd=tmp_path)
    probe = ("import minillm, minillm.ops.build as b; from minillm.model.loader import DEMO_MODEL_DIR, PRESET_DIR; "
             "print(minillm.__file__); print(sorted(p.name for p in b.extension_sources())); "
             "print(sorted(p.name for p in b.CUDA_DIR.iterdir())); print(sorted(p.name for p in DEMO_MODEL_DIR.iterdir())); "
             "print(sorted(p.name for p in PRESET_DIR.iterdir()))")
    out = subprocess.run([sys.executable, "-c", probe], env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    where, sources, cuda_files, demo, presets = out.stdout.splitlines()
    assert where.startswith(str(site))
    repo_cuda = REPO / "minillm" / "cuda"
    assert eval(sources) == sorted([p.name for p in repo_cuda.glob("*.cu")] +
                                   [p.name for p in repo_cuda.glob("*bindings.cpp")])
    assert eval(cuda_files) == sorted(p.name for p in repo_cuda.iterdir() if p.suffix in {".cu", ".cuh", ".h", ".cpp"})
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(eval(demo))
    assert eval(presets)

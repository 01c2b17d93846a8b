"""The CLI: fast --help, lazy commands, flags reaching the config, generate matching the Python API."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from minillm import commands
from minillm.commands import app
from minillm.commands.engine_flags import EngineFlags

ENGINE_ARGS = ["--device", "cpu", "--set", "cache.num_kv_blocks=64"]
COMMANDS = ["generate", "serve-stdin", "serve", "bench", "latency-sweep", "check-kernels"]


def run_cli(*args, input=None):
    return CliRunner().invoke(app, [str(a) for a in args], input=input)


def answers(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# ---------------------------------------------------------------- help and lazy commands

def test_help_lists_every_command_without_importing_torch():
    code = ("import sys; from minillm.commands import app; from typer.testing import CliRunner; "
            "r = CliRunner().invoke(app, ['--help']); print(r.output); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for name in COMMANDS:
        assert name in out.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command):
    result = run_cli(command, "--help")
    assert result.exit_code == 0 and "Usage" in result.output


def test_engine_flags_on_engine_commands():
    result = run_cli("generate", "--help")
    for flag in ("--config", "--model", "--device", "--dtype", "--budget", "--max-model-len", "--no-chunked",
                 "--policy", "--attention", "--attention-mode", "--eager", "--set", "--output"):
        assert flag in result.output


def test_command_whose_module_is_missing_says_not_built(monkeypatch):
    monkeypatch.setitem(commands.COMMANDS, "future-thing", ("minillm.no_such_module", "cmd", "Does a thing."))
    help_result = run_cli("future-thing", "--help")
    assert help_result.exit_code == 0 and "Does a thing." in help_result.output
    result = run_cli("future-thing", "--some-flag", "3")
    assert result.exit_code == 2 and "not built yet" in result.stderr


def test_command_whose_function_is_missing_says_not_built(monkeypatch):
    monkeypatch.setitem(commands.COMMANDS, "future-thing", ("minillm.config", "no_such_command", "Thing."))
    result = run_cli("future-thing")
    assert result.exit_code == 2 and "not built yet" in result.stderr


def greet_command(name: str = "world", *, engine: EngineFlags) -> None:
    """Say hello (a stand-in for a command another module adds)."""
    print(f"hello {name} on {engine.device}")


def test_a_new_command_is_one_registry_entry(monkeypatch):
    from minillm.commands.engine_flags import engine_options
    monkeypatch.setattr(sys.modules[__name__], "greet_command", engine_options(greet_command))
    monkeypatch.setitem(commands.COMMANDS, "greet", (__name__, "greet_command", "Say hello."))
    assert "Say hello." in run_cli("--help").output
    result = run_cli("greet", "--name", "you", "--device", "cpu")
    assert result.exit_code == 0 and result.stdout == "hello you on cpu\n"
    assert "--budget N" in run_cli("greet", "--help").output      # the shared engine flags came with it


def test_commands_sit_on_top_of_the_package():
    """Only minillm/commands/ (and the two entry shims) import the CLI layer: no cycle through it."""
    import ast
    root = Path(commands.__file__).parents[1]
    offenders = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("commands/") or rel in ("cli.py", "__main__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{rel}: {n}" for n in names if n.startswith(("minillm.commands", "minillm.cli"))]
    assert offenders == []


def test_flags_reach_the_engine_config(tmp_path):
    flags = EngineFlags(model="m", device="cpu", dtype="float32", budget=96, max_model_len=128, chunked=False,
                        policy="priority", attention="torch", attention_mode="unified", eager=True,
                        set=["scheduler.max_num_seqs=3", "sampling.max_tokens=5"])
    cfg, sampling = flags.load()
    assert (cfg.model.model, cfg.model.dtype, cfg.model.max_model_len) == ("m", "float32", 128)
    assert (cfg.scheduler.max_num_batched_tokens, cfg.scheduler.enable_chunked_prefill) == (96, False)
    assert (cfg.scheduler.policy, cfg.scheduler.max_num_seqs) == ("priority", 3)
    assert (cfg.runtime.attention, cfg.runtime.attention_mode, cfg.runtime.enforce_eager) == ("torch", "unified",
                                                                                               True)
    assert sampling["max_tokens"] == 5


# ---------------------------------------------------------------- config errors: exit 2 before any work

@pytest.mark.parametrize("args, words", [
    (["--set", "cache.blok_size=16"], ["blok_size", "did you mean 'block_size'"]),
    (["--set", "scheduler.max_num_seqs=0"], ["scheduler.max_num_seqs=0", ">= 1"]),
    (["--policy", "lifo"], ["scheduler.policy='lifo'", "fcfs, priority, static"]),
    (["--budget", "0"], ["scheduler.max_num_batched_tokens=0"]),
    (["--config", "missing.yaml"], ["config file not found", "missing.yaml"]),
    (["--set", "sampling.top_p=2"], ["top_p"]),
])
def test_config_errors_exit_2_naming_the_key(tmp_path, args, words):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    for command in (["generate", prompts], ["serve-stdin"]):
        result = run_cli(*command, *args)
        assert result.exit_code == 2 and result.stdout == ""
        for word in words:
            assert word in result.stderr


# ---------------------------------------------------------------- generate = the Python API

PROMPTS = [{"id": "t", "prompt": "The function returns"},
           {"id": "ids", "prompt_token_ids": [11, 12, 13, 14]},
           {"id": "chat", "messages": [{"role": "user", "content": "What is a list?"}]}]


def test_generate_greedy_equals_python_api(tiny_model, tmp_path):
    from minillm import LLM, SamplingParams
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    out_file = tmp_path / "out.jsonl"
    result = run_cli("generate", path, "-o", out_file, "--model", tiny_model, *ENGINE_ARGS,
                     "--set", "sampling.temperature=0", "--set", "sampling.max_tokens=8")
    assert result.exit_code == 0, result.output
    assert "requests ok" in result.stderr            # the summary table
    got = answers(out_file.read_text())
    llm = LLM(str(tiny_model), device="cpu", num_kv_blocks=64)
    ref = llm.generate([p.get("prompt") or p.get("prompt_token_ids") or p["messages"] for p in PROMPTS],
                       SamplingParams(temperature=0, top_p=0.9, max_tokens=8), use_tqdm=False)
    assert [a["id"] for a in got] == ["t", "ids", "chat"]
    for a, r in zip(got, ref):
        assert (a["token_ids"], a["text"], a["finish_reason"]) == (r.token_ids, r.text, r.finish_reason)
        assert a["usage"] == {"prompt_tokens": len(r.prompt_token_ids), "completion_tokens": len(r.token_ids)}


def test_generate_subprocess_from_stdin_with_logprobs(tiny_model):
    lines = (json.dumps({"id": 1, "prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                         "logprobs": 2}) + "\n").encode()
    out = subprocess.run([sys.executable, "-m", "minillm", "generate", "-", "--model", str(tiny_model),
                          *ENGINE_ARGS, "--no-progress"], input=lines, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()
    (answer,) = answers(out.stdout.decode())
    assert answer["id"] == 1 and len(answer["token_ids"]) == 3
    assert [lp["token_id"] for lp in answer["logprobs"]] == answer["token_ids"]
    assert all(len(lp["top"]) == 2 and lp["logprob"] <= 0 for lp in answer["logprobs"])


def test_generate_n_completions(tiny_model, tmp_path):
    path = tmp_path / "n.jsonl"
    path.write_text('{"id": "n", "prompt": "x", "n": 3, "max_tokens": 2, "ignore_eos": true, "seed": 1}\n')
    result = run_cli("generate", path, "--model", tiny_model, *ENGINE_ARGS, "--no-progress")
    (answer,) = answers(result.stdout)
    assert [o["index"] for o in answer["outputs"]] == [0, 1, 2]
    assert answer["usage"]["completion_tokens"] == 6 and answer["token_ids"] == answer["outputs"][0]["token_ids"]


def test_serve_stdin_in_process_stdin(tiny_model):
    lines = '{"id": "a", "prompt": "Hi", "max_tokens": 2, "ignore_eos": true}\n{"abort": "zzz"}\n'
    result = run_cli("serve-stdin", "--model", tiny_model, *ENGINE_ARGS, input=lines)
    assert result.exit_code == 0, result.output
    events = answers(result.stdout)
    assert [e["event"] for e in events if e["id"] == "a"][-1] == "done"
    assert [e["event"] for e in events if e["id"] == "zzz"] == ["error"]


# ---------------------------------------------------------------- readable help, README commands



@pytest.mark.parametrize("command", [[], *([c] for c in COMMANDS)])
def test_help_reads_like_a_man_page(command):
    text = run_cli(*command, "--help").output
    for tag in ("<bool>", "<str>", "<int>", "<path>", "<float>", "{input}", "{INPUT}"):
        assert tag not in text, (command, tag)
    assert max(len(line) for line in text.splitlines()) <= 80


def test_generate_help_names_every_field_and_the_exit_codes():
    from minillm.serve.requests import ALLOWED_KEYS
    text = run_cli("generate", "--help").output
    assert "Usage: minillm generate [OPTIONS] INPUT" in text
    missing = [key for key in ALLOWED_KEYS if key not in text]
    assert missing == []
    for word in ("Exit status", "0 every line answered", "2 usage", "130", "143"):
        assert word in text


def test_check_kernels_without_a_gpu_says_so_on_stderr():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    result = run_cli("check-kernels", "--quick")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("minillm: error: ") and "no GPU" in result.stderr


def readme_commands() -> list[list[str]]:
    import shlex
    readme = Path(__file__).resolve().parents[1] / "README.md"
    lines = [shlex.split(line.strip())[1:] for line in readme.read_text().splitlines()
             if line.startswith("    minillm ")]
    return [args for args in lines if not any(a.startswith("[") for a in args)]   # not a usage synopsis


@pytest.mark.parametrize("args", readme_commands(), ids=" ".join)
def test_every_readme_command_parses(args):
    """Each `minillm ...` line of README names a real command and real flags (parsed, not run)."""
    group = typer.main.get_command(app)
    with group.make_context("minillm", list(args), resilient_parsing=False) as ctx:
        name, cmd, rest = group.resolve_command(ctx, list(args))
        cmd.make_context(name, rest, parent=ctx)


def test_readme_installs_torch_before_the_project_with_the_cpu_build_as_alternative():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    setup = readme.split("## Set up", 1)[1].split("##", 1)[0]
    steps = [line.strip() for line in setup.splitlines() if line.startswith("    python")]
    assert steps[:3] == ['python -m pip install "torch>=2.11"', 'python -m pip install -e ".[dev]"',
                         "python -m pytest -q"]   # as .ci/run installs it: a plain pip install
    assert "download.pytorch.org/whl/cpu" in steps[3] and "CUDA build" in setup
    assert "hf download" in readme and "huggingface-cli" not in readme


# ---------------------------------------------------------------- serve's own flags

@pytest.mark.parametrize("args, words", [
    (["--log-level", "bogus"], ["--log-level='bogus'", "critical, error, warning, info, debug, trace"]),
    (["--drain-timeout", "inf"], ["--drain-timeout=inf", "[0, 86400]"]),
    (["--drain-timeout", "nan"], ["--drain-timeout=nan"]),
    (["--drain-timeout", "-1"], ["--drain-timeout=-1.0"]),
    (["--drain-timeout", "1e300"], ["--drain-timeout=1e+300"]),
])
def test_serve_refuses_bad_server_flags_before_the_model_loads(args, words):
    # The model does not exist: a check that ran after loading would report the model instead.
    result = run_cli("serve", "--model", "/nonexistent/model-dir", "--port", "0", *args)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("minillm: error: ") and "nonexistent" not in result.stderr
    for word in words:
        assert word in result.stderr


def test_serve_log_level_is_case_blind_and_help_has_exit_codes():
    from minillm.commands.serve import _check_server_flags
    assert _check_server_flags("WARNING", 0.0) == "warning"
    text = run_cli("serve", "--help").output
    for word in ("Exit status", "0 stopped by SIGTERM", "2 usage", "130", "LEVEL"):
        assert word in text


def test_help_tidying_works_with_click_style_parameter_types():
    """Older typer releases give options click's types and no display_type(): the tidying must read those."""
    import types
    from minillm.commands.common import _type_label
    assert _type_label(types.SimpleNamespace(type=types.SimpleNamespace(name="integer"))) == "integer"
    assert _type_label(types.SimpleNamespace(type=types.SimpleNamespace(name="integer range"))) == "integer"
    assert _type_label(types.SimpleNamespace(type=types.SimpleNamespace(name="choice", choices=["a", "b"]))) == "a|b"
    assert _type_label(types.SimpleNamespace(display_type=lambda ctx: "<float>")) == "float"


def test_bench_outputs_default_to_an_ignored_scratch_folder():
    """A README `bench` / `latency-sweep` line run in a checkout must not append to the tracked results/ files."""
    repo = Path(__file__).resolve().parents[1]
    for name, keys in (("bench", {"output"}), ("latency-sweep", {"output", "plot"})):
        defaults = {p.name: Path(str(p.default)) for p in commands._load(name).params if p.name in keys}
        assert set(defaults) == keys and all(d.parts[0] == "minillm-results" for d in defaults.values()), defaults
    assert "/minillm-results/" in (repo / ".gitignore").read_text().splitlines()
    ignored = subprocess.run(["git", "check-ignore", "-q", "minillm-results/bench.jsonl"], cwd=repo)
    assert ignored.returncode in (0, 128)   # 128: not a git checkout (an unpacked sdist); nothing to check then

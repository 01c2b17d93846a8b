"""The embedded demo model: its files and shape contract, and that `minillm generate` on it prints words."""
import json
import re
import subprocess
import sys
from pathlib import Path

from safetensors import safe_open

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "minillm" / "demo_model"
# Words any English text about code is full of; noise from an untrained model would contain almost none.
COMMON = {"the", "a", "an", "of", "to", "is", "and", "in", "or", "for", "be", "if", "it", "this", "that", "are",
          "return", "returns", "object", "value", "string", "file", "list", "name", "with", "not", "by", "as"}


def test_files_and_size():
    names = {p.name for p in DEMO.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    assert sum(p.stat().st_size for p in DEMO.iterdir()) <= 8 * 1024 * 1024


def test_config_is_qwen3_with_kernel_friendly_shape():
    cfg = json.loads((DEMO / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["head_dim"] == 64 and cfg["tie_word_embeddings"] is True
    assert cfg["num_attention_heads"] == 2 * cfg["num_key_value_heads"]       # GQA ratio 2
    with safe_open(str(DEMO / "model.safetensors"), "pt") as f:
        dtypes = {str(f.get_slice(name).get_dtype()) for name in f.keys()}
        assert "lm_head.weight" not in f.keys()                               # tied to the embedding
    assert dtypes == {"BF16"}


def test_tokenizer_chat_template_and_eos():
    from minillm.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(DEMO)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")} <= tok.eos_token_ids
    assert tok.decode(tok.encode("Return the value.")) == "Return the value."


def test_generate_examples_prints_english_words():
    out = subprocess.run([sys.executable, "-m", "minillm", "generate", "examples/prompts.jsonl", "--device", "cpu",
                          "--set", "sampling.temperature=0", "--no-progress"], cwd=ROOT, capture_output=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr.decode()
    answers = [json.loads(line) for line in out.stdout.decode().splitlines()]
    n_prompts = sum(1 for line in (ROOT / "examples" / "prompts.jsonl").read_text().splitlines() if line.strip())
    assert len(answers) == n_prompts and all("error" not in a for a in answers)
    words = re.findall(r"[A-Za-z']+", " ".join(a["text"] for a in answers).lower())
    assert len(words) >= 20
    assert sum(w in COMMON for w in words) / len(words) >= 0.15, words


def test_default_llm_is_the_demo_model_and_cli_matches_it(tmp_path):
    from minillm import LLM, SamplingParams
    prompts = ["Return the", "This module"]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    out = subprocess.run([sys.executable, "-m", "minillm", "generate", str(path), "--device", "cpu", "--no-progress",
                          "--set", "sampling.temperature=0", "--set", "sampling.max_tokens=12"], cwd=ROOT,
                         capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode()
    got = [json.loads(line)["token_ids"] for line in out.stdout.decode().splitlines()]
    llm = LLM(device="cpu", num_kv_blocks=256)
    ref = llm.generate(prompts, SamplingParams(temperature=0, top_p=0.9, max_tokens=12), use_tqdm=False)
    assert got == [r.token_ids for r in ref]


def test_library_leaves_the_heap_alone_and_the_bench_freezes_and_unfreezes_it():
    """LLM() changes no process-wide state (the caller owns the heap); the bench, a serving process, moves its
    start-up objects out of the cycle collector's reach (no full-collection pause while timing) and hands them
    back when it drops the engine, so the dropped engine can be collected."""
    import gc

    from minillm import LLM
    from minillm.bench.offline import build_llm, free_device_memory
    from minillm.config import EngineConfig

    gc.unfreeze()
    llm = LLM(str(DEMO), device="cpu", num_kv_blocks=256)
    assert gc.get_freeze_count() == 0
    del llm
    llm, _ = build_llm(EngineConfig.from_kwargs(str(DEMO), device="cpu", num_kv_blocks=256))
    assert gc.get_freeze_count() > 10_000
    del llm
    free_device_memory()
    assert gc.get_freeze_count() == 0

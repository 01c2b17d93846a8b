"""Train the embedded demo model (minillm/demo_model/): a tiny Qwen3 that writes English-looking text.

Corpus: the docstrings of Python's standard library, gathered with inspect from the modules that import cleanly,
so the script needs no download. A byte-level BPE tokenizer is trained on the same text, then a 4-layer Qwen3
(head_dim 64, 4 query heads, 2 KV heads, tied embeddings) is trained for a fixed number of steps on CPU and
saved in Hugging Face format with bf16 weights (about 7 MB in all).

    nice python scripts/train_demo_model.py                        # ~12 CPU-minutes (stops at 14)
    nice python scripts/train_demo_model.py --steps 20 --out /tmp/demo   # quick smoke run

Part of the corpus is wrapped in the Qwen chat format, so that chat prompts (`messages`) get an answer that ends
with <|im_end|> instead of running on.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import json
import math
import os
import pkgutil
import random
import sys
import time
import warnings
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning: on a shared machine spinning burns CPU time for nothing.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402 - after OMP_WAIT_POLICY, which OpenMP reads when torch loads it

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "minillm" / "demo_model"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Modules with side effects on import (open windows or browsers, print, start servers) or that are slow.
SKIP_MODULES = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "__hello__", "__phello__",
                "lib2to3", "pydoc_data", "ensurepip", "venv", "test", "tests", "msilib", "winreg", "winsound", "_winapi"}
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def model_config(vocab_size: int) -> dict:
    """Sized to stay under 8 MB in bf16 while keeping head_dim 64 so the CUDA kernels can run it."""
    return dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=vocab_size, hidden_size=256,
        intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=True, attention_bias=False, attention_dropout=0.0, use_cache=True,
        bos_token_id=None, eos_token_id=[vocab_ids(SPECIALS[2]), vocab_ids(SPECIALS[0])],
        pad_token_id=vocab_ids(SPECIALS[0]), torch_dtype="bfloat16",
    )


def vocab_ids(token: str) -> int:
    # Special tokens are added first when the tokenizer is trained, so their ids are their list positions.
    return SPECIALS.index(token)


# ---------------------------------------------------------------- corpus

def _import_quietly(name: str):
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - a module that fails to import (even by SystemExit) is skipped
            return None


def _docs_of(module, seen: set[str]) -> list[tuple[str, str]]:
    """(qualified name, docstring) for the module and its public classes, functions and methods."""
    out = []

    def add(name: str, obj) -> None:
        doc = inspect.getdoc(obj)
        # The same text appears under several names (io and _pyio, re-exports): keep the first only.
        if doc and len(doc) >= 40 and doc not in seen:
            seen.add(doc)
            out.append((name, doc))

    add(module.__name__, module)
    for attr, obj in sorted(vars(module).items()):
        if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj):
            add(f"{module.__name__}.{attr}", obj)
            for meth, fn in sorted(vars(obj).items()):
                if not meth.startswith("_") and callable(fn):
                    add(f"{module.__name__}.{attr}.{meth}", fn)
        elif callable(obj):
            add(f"{module.__name__}.{attr}", obj)
    return out


def _stdlib_modules():
    """Every importable standard-library module and submodule, minus the skip list and test packages."""
    for name in sorted(sys.stdlib_module_names):
        if name in SKIP_MODULES:
            continue
        module = _import_quietly(name)
        if module is None:
            continue
        yield module
        for info in pkgutil.walk_packages(getattr(module, "__path__", []), name + "."):
            if not SKIP_MODULES.intersection(info.name.split(".")) and ".test" not in info.name:
                sub = _import_quietly(info.name)
                if sub is not None:
                    yield sub


def collect_docstrings() -> list[tuple[str, str]]:
    seen: set[str] = set()
    return [doc for module in _stdlib_modules() for doc in _docs_of(module, seen)]


def to_documents(docs: list[tuple[str, str]], rng: random.Random) -> list[str]:
    """Plain documents end with <|endoftext|>; a third become a chat turn that ends with <|im_end|>."""
    out = []
    for name, doc in docs:
        if rng.random() < 1 / 3:
            question = rng.choice(["What does {} do?", "Explain {}.", "Tell me about {}.", "Describe {}."])
            answer = doc.split("\n\n")[0]
            out.append(f"<|im_start|>user\n{question.format(name)}<|im_end|>\n"
                       f"<|im_start|>assistant\n{answer}<|im_end|>\n")
        else:
            out.append(f"{name}\n\n{doc}<|endoftext|>")
    return out


# ---------------------------------------------------------------- tokenizer

def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    assert [tok.token_to_id(s) for s in SPECIALS] == [0, 1, 2], "special tokens must take ids 0..2"
    return tok


def write_tokenizer_files(tok, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    added = {str(i): {"content": s, "lstrip": False, "rstrip": False, "normalized": False,
                      "single_word": False, "special": True} for i, s in enumerate(SPECIALS)}
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 2048, "added_tokens_decoder": added,
           "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
           "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"eos_token_id": [vocab_ids("<|im_end|>"), vocab_ids("<|endoftext|>")],
           "pad_token_id": vocab_ids("<|endoftext|>"), "do_sample": True, "temperature": 0.7, "top_p": 0.9}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


# ---------------------------------------------------------------- model

def batches(ids: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    """Endless random windows of seq tokens from the concatenated corpus."""
    while True:
        starts = torch.randint(0, len(ids) - seq, (batch,), generator=gen)
        yield torch.stack([ids[s:s + seq] for s in starts.tolist()])


def lr_at(frac: float, peak: float) -> float:
    """Linear warm-up over the first 5% of the steps, then cosine decay to 10% of the peak."""
    if frac < 0.05:
        return peak * frac / 0.05
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * (frac - 0.05) / 0.95)))


def train(model, ids: torch.Tensor, args) -> None:
    """A fixed number of steps (so the result does not depend on how busy the machine is), with a CPU-time
    guard that stops early rather than exceed the budget."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    cpu0, wall0 = time.process_time(), time.monotonic()
    model.train()
    for step, batch in zip(range(args.steps), batches(ids, args.batch, args.seq, gen)):
        cpu = time.process_time() - cpu0
        if cpu > args.max_cpu_minutes * 60:
            print(f"stopping at step {step}: CPU budget of {args.max_cpu_minutes} minutes used", flush=True)
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step / args.steps, args.lr)
        # labels=inputs: HF shifts internally, so position t is scored on token t + 1.
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  cpu {cpu / 60:5.1f} min  wall {(time.monotonic() - wall0) / 60:5.1f} min  "
                  f"loss {loss.item():.3f}", flush=True)


def sample_text(model, tok, prompt: str) -> str:
    model.eval()
    ids = torch.tensor([tok.encode(prompt).ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=40, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--max-cpu-minutes", type=float, default=14.0, help="stop early past this much CPU time")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    docs = collect_docstrings()
    texts = to_documents(docs, rng)
    rng.shuffle(texts)
    print(f"corpus: {len(docs)} docstrings, {sum(map(len, texts)) / 1e6:.1f} M characters", flush=True)

    tok = train_tokenizer(texts, args.vocab)
    ids = torch.tensor([i for enc in tok.encode_batch(texts) for i in enc.ids], dtype=torch.long)
    print(f"corpus: {len(ids) / 1e6:.2f} M tokens", flush=True)

    cfg_dict = model_config(tok.get_vocab_size())
    model = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in cfg_dict.items() if k != "architectures"}))
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters", flush=True)
    train(model, ids, args)

    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    # save_pretrained writes its own config; rewrite it with exactly the fields the engine documents.
    (args.out / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n")
    write_tokenizer_files(tok, args.out)
    model.to(torch.float32)
    for prompt in ("The function", "<|im_start|>user\nWhat does json.dumps do?<|im_end|>\n<|im_start|>assistant\n"):
        print(repr(prompt), "->", repr(sample_text(model, tok, prompt)), flush=True)


if __name__ == "__main__":
    main()

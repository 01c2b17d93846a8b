"""Compiling GrammarSpecs with xgrammar, off the engine thread, behind a bounded cache.

One GrammarService per (model directory, vocabulary width, structured config) in a process (grammar_service()):
the front end submits a spec when a request arrives and waits for it there (HTTP: awaited on the event loop;
JSONL: at admission), so the engine thread only ever finds finished grammars in the cache. Bounds, all from the
`structured` config section: the spec's size before anything compiles, the compile time (a compile that runs
past compile_timeout_s is refused; its worker finishes in the background, it cannot be interrupted), and the
compiled grammar's size. Refusals are SpecErrors naming the request's parameter.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout
from pathlib import Path

from minillm.config import StructuredConfig
from minillm.structured.spec import GrammarSpec, SpecError

_LIB_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")   # "[22:29:07] /project/cpp/x.cc:94: " in xgrammar errors


def tokenizer_info(tokenizer_json: Path, vocab_size: int):
    """xgrammar's view of the vocabulary, from tokenizer.json alone (no transformers needed). Special added
    tokens get an empty text, which xgrammar never allows inside a grammar (stop tokens are set per matcher)."""
    import xgrammar as xgr
    from tokenizers import Tokenizer

    data = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    tok = Tokenizer.from_file(str(tokenizer_json))
    encoded = [""] * vocab_size
    for text, i in tok.get_vocab(with_added_tokens=True).items():
        if 0 <= i < vocab_size:
            encoded[i] = text
    for added in data.get("added_tokens") or []:
        if added.get("special") and 0 <= added.get("id", -1) < vocab_size:
            encoded[added["id"]] = ""
    vocab_type, prefix_space = _vocab_type(data.get("decoder"))
    return xgr.TokenizerInfo(encoded, getattr(xgr.VocabType, vocab_type), vocab_size=vocab_size,
                             stop_token_ids=[], add_prefix_space=prefix_space)


def _vocab_type(decoder) -> tuple[str, bool]:
    """How token texts map to bytes: GPT-2 byte-level (Qwen), sentencepiece byte fallback, or raw text."""
    parts = decoder.get("decoders", [decoder]) if isinstance(decoder, dict) else []
    types = {p.get("type") for p in parts if isinstance(p, dict)}
    if "ByteLevel" in types:
        return "BYTE_LEVEL", False
    if "ByteFallback" in types:
        return "BYTE_FALLBACK", bool(types & {"Metaspace", "Strip"})
    return "RAW", False


class GrammarService:
    def __init__(self, tokenizer_json: Path, vocab_size: int, cfg: StructuredConfig):
        import xgrammar as xgr

        self.cfg = cfg
        self.vocab_size = vocab_size
        self.info = tokenizer_info(tokenizer_json, vocab_size)
        # xgrammar's own cache is off: ours is keyed by the spec and bounded by count.
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(cfg.compile_threads, thread_name_prefix="minillm-grammar")
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._lock = threading.Lock()

    def submit(self, spec: GrammarSpec) -> Future:
        """Start compiling (or find) a spec; never blocks. The future holds the CompiledGrammar or a SpecError."""
        if len(spec.text.encode("utf-8")) > self.cfg.max_spec_bytes:
            fut: Future = Future()
            fut.set_exception(SpecError(spec.param, f"{spec.param} is {len(spec.text.encode())} bytes; the limit "
                                        f"is {self.cfg.max_spec_bytes} (structured.max_spec_bytes)"))
            return fut
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None:
                self._cache.move_to_end(spec)
                return fut
            fut = self._pool.submit(self._compile, spec)
            self._cache[spec] = fut
            while len(self._cache) > self.cfg.cache_size:
                self._cache.popitem(last=False)
        return fut

    def compiled(self, spec: GrammarSpec):
        """The CompiledGrammar, waiting at most compile_timeout_s; raises SpecError (bad spec, too slow, too big)."""
        fut = self.submit(spec)
        try:
            return fut.result(timeout=self.cfg.compile_timeout_s)
        except FutureTimeout:
            raise SpecError(spec.param, f"{spec.param} did not compile within {self.cfg.compile_timeout_s:g} s "
                            "(structured.compile_timeout_s); simplify it") from None

    def _compile(self, spec: GrammarSpec):
        try:
            grammar = self._build(spec)
        except SpecError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:   # xgrammar's parse and conversion errors
            raise SpecError(spec.param, f"{spec.param} was refused by the grammar compiler: "
                            f"{_clean(str(e))}") from None
        size = grammar.memory_size_bytes
        if size > self.cfg.max_grammar_bytes:
            raise SpecError(spec.param, f"{spec.param} compiles to {size} bytes; the limit is "
                            f"{self.cfg.max_grammar_bytes} (structured.max_grammar_bytes)")
        return grammar

    def _build(self, spec: GrammarSpec):
        c, kind = self._compiler, spec.kind
        if kind == "json":
            return c.compile_json_schema(spec.text, **self.json_options())
        if kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', strict_mode=False, **self.json_options())
        if kind == "regex":
            return c.compile_regex(spec.text)
        if kind == "choice":
            return c.compile_grammar(choice_ebnf(json.loads(spec.text)))
        if kind == "grammar":
            return c.compile_grammar(spec.text)
        from minillm.structured.tools import tool_call_grammar   # kind == "tool_call"
        return c.compile_grammar(tool_call_grammar(json.loads(spec.text), self.json_options()))

    def json_options(self) -> dict:
        """Whitespace of every JSON grammar: none at all (compact), or runs of at most max_whitespace characters,
        so a model cannot stall emitting spaces inside an object until max_tokens."""
        if self.cfg.json_whitespace == "compact":
            return {"any_whitespace": False, "separators": (",", ":")}
        return {"any_whitespace": True, "max_whitespace_cnt": self.cfg.max_whitespace}


def choice_ebnf(choices: list[str]) -> str:
    # JSON string escapes are EBNF string escapes too (\", \\, \n, \uXXXX).
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _clean(message: str) -> str:
    first = message.strip().splitlines()[0] if message.strip() else "unknown error"
    return _LIB_PREFIX.sub("", first)[:300]


_SERVICES: dict[tuple, GrammarService] = {}
_SERVICES_LOCK = threading.Lock()   # the front end and the engine thread may ask first at the same time


def grammar_service(model_dir: Path | str | None, vocab_size: int, cfg: StructuredConfig) -> GrammarService:
    """The process's service for this model (the front end and the runner share it, hence its cache)."""
    path = Path(model_dir) / "tokenizer.json" if model_dir is not None else None
    if path is None or not path.is_file():
        raise SpecError("structured_outputs", "structured outputs need the model's tokenizer.json, and this model "
                        "directory has none")
    key = (str(path.resolve()), vocab_size, cfg)
    with _SERVICES_LOCK:
        if key not in _SERVICES:
            _SERVICES[key] = GrammarService(path, vocab_size, cfg)
        return _SERVICES[key]

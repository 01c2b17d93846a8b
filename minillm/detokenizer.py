"""Incremental detokenization with stop strings: the text a stream may show after each step.

Two things are held back from the stream:
- an incomplete UTF-8 character: a byte-level token may carry only part of a character, and decoding then
  ends in U+FFFD; those tokens wait until the character completes;
- a possible stop string start: the longest suffix of the text that is a prefix of some stop string, because
  the next token may complete the stop string, and no part of it may ever be emitted.

Decoding is O(new tokens): only a sliding window of recent token ids is decoded each call. ``prefix_offset``
marks where the window starts (a little context, so that decoders that depend on the preceding token decode
the new tokens exactly as a full decode would) and ``read_offset`` marks the first token whose text has not
been produced yet; text = decode(window)[len(decode(prefix part)):]. With a byte-level decoder
(Tokenizer.decodes_by_concatenation) a single new token on a caught-up stream needs no decode at all: its
text is that token's own, cached per tokenizer.
"""
from __future__ import annotations

import weakref
from typing import Sequence

from minillm.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Per tokenizer: (token id, skip_special_tokens) -> that token decoded on its own. In a stream of one token per
# step the prefix window is the previous token alone, so this halves the decodes; at most 2 x vocab entries.
_SINGLE_TOKEN_TEXT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] | None = None,
                 skip_special_tokens: bool = True) -> None:
        stop = list(stop or [])
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {stop!r}")
        self._tokenizer = tokenizer
        self._stop = stop
        self._skip_special = skip_special_tokens
        by_flag = _SINGLE_TOKEN_TEXT.setdefault(tokenizer, {})
        self._single_texts: dict[int, str] = by_flag.setdefault(skip_special_tokens, {})
        # A byte-level decoder: one new token extends a caught-up stream by that token's own (cached) text.
        self._concat = bool(getattr(tokenizer, "decodes_by_concatenation", False))
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._held = ""          # decoded text not yet emitted (a possible stop-string start)
        self._emitted: list[str] = []
        self.stopped = False
        self.stop_string: str | None = None

    @property
    def text(self) -> str:
        """Everything emitted so far (add() and flush() results concatenated)."""
        return "".join(self._emitted)

    def add(self, token_ids: Sequence[int]) -> str:
        """Take new token ids; return the newly safe text ("" once a stop string was seen)."""
        if self.stopped:
            return ""
        ids = self._ids
        if self._concat and len(token_ids) == 1 and self._read_offset == len(ids):
            # NOTE: the common case, once per request per step: no tokenizer call (~8 us each at 256 rows).
            # The stream so far ends on a character boundary, so the decode of the window would be the
            # prefix's text plus this token's; an unfinished character goes the general way (it waits).
            token = token_ids[0]
            text = self._single_texts.get(token)
            if text is None:
                text = self._decode_one(token)
            if not text.endswith(_REPLACEMENT):
                ids.append(token)
                self._prefix_offset = self._read_offset
                self._read_offset = len(ids)
                if self._stop:
                    return self._release(text, final=False)
                self._emitted.append(text)
                return text
        ids.extend(token_ids)
        return self._release(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """End of the request: release what was held back (an unfinished character decodes as U+FFFD, as a
        full decode would show it). Text past a stop string is never released."""
        if self.stopped:
            return ""
        return self._release(self._decode_new(final=True), final=True)

    def _decode_new(self, final: bool) -> str:
        if len(self._ids) == self._read_offset:
            return ""
        start, read = self._prefix_offset, self._read_offset
        prefix_text = self._decode_one(self._ids[start]) if read - start == 1 else self._decode(self._ids[start:read])
        full_text = self._decode(self._ids[start:])
        if full_text.endswith(_REPLACEMENT) and not final:
            return ""  # the last character is still incomplete: wait for its remaining bytes
        # NOTE: the window always starts on a character boundary (offsets only move after a complete decode),
        # so prefix_text is a true prefix of full_text.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text):]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_one(self, token_id: int) -> str:
        texts = self._single_texts
        text = texts.get(token_id)
        if text is None:
            text = texts[token_id] = self._decode([token_id])
        return text

    def _release(self, new_text: str, final: bool) -> str:
        if not self._stop:           # nothing is ever held back: the common streaming case, once per token
            self._emitted.append(new_text)
            return new_text
        pending = self._held + new_text
        hit = self._find_stop(pending)
        if hit is not None:
            cut, self.stop_string = hit
            self.stopped = True
            out, self._held = pending[:cut], ""
        else:
            keep = 0 if final else self._stop_prefix_len(pending)
            out, self._held = pending[:len(pending) - keep], pending[len(pending) - keep:]
        self._emitted.append(out)
        return out

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """Earliest stop string in ``text`` (ties: the longest). The emitted text never ends with a stop
        prefix, so every occurrence lies entirely inside the held + new text searched here."""
        best: tuple[int, str] | None = None
        for s in self._stop:
            i = text.find(s)
            if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(s) > len(best[1]))):
                best = (i, s)
        return best

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string. Only the
        positions of a stop string's first character in the text's tail are tried (str.find, in C), so a step
        costs about the stop strings' total length, which minillm/limits.py bounds."""
        longest = 0
        for s in self._stop:
            if len(s) < 2:
                continue
            tail = text[-(len(s) - 1):]
            i = tail.find(s[0])
            while i >= 0 and len(tail) - i > longest:
                if s.startswith(tail[i:]):
                    longest = len(tail) - i
                    break
                i = tail.find(s[0], i + 1)
        return longest

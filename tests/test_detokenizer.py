"""Incremental detokenizer: streamed pieces equal the full decode, no broken characters at chunk boundaries,
stop strings never partly emitted, O(new tokens) decoding."""
import random

import pytest
from test_tokenizer import write_tokenizer_dir

from minillm.detokenizer import IncrementalDetokenizer
from minillm.tokenizer import Tokenizer

TEXTS = [
    "naïve café 日本語のテキスト 😀🎉 👍🏽 Ελληνικά 한국어",
    "中文字符测试 the quick brown fox 🎉🎉 façade Ørsted",
    "plain ascii only, nothing special here",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(write_tokenizer_dir(tmp_path_factory.mktemp("tok")))


class CountingTokenizer:
    """Wraps a Tokenizer and records the length of every decoded id window."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.window_lengths: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.window_lengths.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def chunks(ids, rng):
    i = 0
    while i < len(ids):
        n = rng.randint(1, 3)
        yield ids[i:i + n]
        i += n


def stream(detok, ids, rng=None):
    pieces = [detok.add(c) for c in (chunks(ids, rng) if rng else ([i] for i in ids))]
    return pieces, detok.flush()


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunked", [False, True])
def test_streamed_pieces_concatenate_to_full_decode(tok, text, chunked):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [])
    pieces, tail = stream(detok, ids, random.Random(len(text)) if chunked else None)
    assert "".join(pieces) + tail == tok.decode(ids) == text
    assert tail == ""                       # complete text: nothing left to flush
    assert detok.text == text
    assert not any("\ufffd" in p for p in pieces)


def test_incomplete_character_held_until_complete(tok):
    ids = tok.encode("日")
    assert len(ids) > 1  # the character spans several byte tokens
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.add([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "日"


def test_flush_releases_an_unfinished_character_as_full_decode_shows_it(tok):
    ids = tok.encode("ab 日")[:-1]
    detok = IncrementalDetokenizer(tok, [])
    streamed = "".join(detok.add([i]) for i in ids)
    assert streamed + detok.flush() == tok.decode(ids)
    assert tok.decode(ids).endswith("\ufffd")


def test_decoding_window_stays_small(tok):
    counter = CountingTokenizer(tok)
    ids = tok.encode(" ".join(TEXTS * 20))
    detok = IncrementalDetokenizer(counter, [])
    pieces, tail = stream(detok, ids)
    assert "".join(pieces) + tail == tok.decode(ids)
    assert len(ids) > 500
    # A window spans at most one unfinished character (4 byte tokens here) plus the previous step's tokens.
    assert max(counter.window_lengths) <= 8


@pytest.mark.parametrize("text, stop, expected", [
    ("the quick brown fox jumps over the lazy dog", ["fox jumps"], "the quick brown "),
    ("naïve café 日本語のテキスト 😀🎉 end", ["テキ"], "naïve café 日本語の"),
    ("emoji 😀🎉 then stop here", ["🎉 then"], "emoji 😀"),
    ("aaa stop bbb end ccc", ["end", "stop"], "aaa "),             # earliest stop wins
])
@pytest.mark.parametrize("chunked", [False, True])
def test_stop_string_cut_and_never_partly_emitted(tok, text, stop, expected, chunked):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, stop)
    rng = random.Random(1) if chunked else None
    emitted = ""
    for piece in (chunks(ids, rng) if rng else ([i] for i in ids)):
        emitted += detok.add(piece)
        # Everything shown so far is part of the final text: no prefix of a stop string leaked.
        assert expected.startswith(emitted)
    assert detok.stopped and detok.stop_string in stop
    assert text.find(detok.stop_string) == len(expected)
    assert emitted == expected == detok.text
    assert detok.add(tok.encode(" more")) == "" and detok.flush() == ""


def test_stop_strings_span_several_tokens(tok):
    # The cases above are only meaningful if the stop strings do not arrive as one token.
    for s in ("fox jumps", "テキ", "🎉 then"):
        assert len(tok.encode(s)) > 1


def test_held_stop_prefix_released_when_it_diverges_or_at_flush(tok):
    detok = IncrementalDetokenizer(tok, ["lazy cat"])
    out = "".join(detok.add([i]) for i in tok.encode("the lazy"))
    assert out == "the "                    # "lazy" could still become "lazy cat"
    assert detok.add(tok.encode(" dog")) == "lazy dog"
    detok2 = IncrementalDetokenizer(tok, ["lazy cat"])
    assert detok2.add(tok.encode("over the lazy")) == "over the "
    assert detok2.flush() == "lazy"
    assert detok2.text == "over the lazy" and not detok2.stopped


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("hi<|im_end|>")
    assert IncrementalDetokenizer(tok, []).add(ids) == "hi"
    assert IncrementalDetokenizer(tok, [], skip_special_tokens=False).add(ids) == "hi<|im_end|>"


def test_stop_string_made_of_a_special_token(tok):
    detok = IncrementalDetokenizer(tok, ["<|im_end|>"], skip_special_tokens=False)
    assert detok.add(tok.encode("done<|im_end|>tail")) == "done"
    assert detok.stop_string == "<|im_end|>"


def test_bad_stop_rejected(tok):
    with pytest.raises(ValueError, match="stop must be a list of non-empty strings"):
        IncrementalDetokenizer(tok, [""])


def test_stop_prefix_len_matches_the_plain_definition():
    """The held-back length is the longest suffix of the text that is a proper prefix of a stop string."""
    rng = random.Random(0)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 8)))
        want = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        detok = IncrementalDetokenizer.__new__(IncrementalDetokenizer)
        detok._stop = stops
        assert detok._stop_prefix_len(text) == want, (stops, text)


class ConcatCountingTokenizer(CountingTokenizer):
    decodes_by_concatenation = True


def test_tokenizer_knows_its_decoder_is_byte_level(tok):
    assert tok.decodes_by_concatenation      # the test tokenizer (and Qwen's) decode bytes joined


@pytest.mark.parametrize("stop", [[], ["ab", "日本"]])
@pytest.mark.parametrize("skip_special", [True, False])
def test_byte_level_shortcut_gives_what_the_window_decode_gives(tok, stop, skip_special):
    """Random id streams (byte fragments of characters, special tokens, multi-token chunks): the shortcut for
    one token on a caught-up stream returns, step by step, exactly what the general window decode returns."""
    rng = random.Random(7)
    vocab = tok.vocab_size
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 24))]
        fast = IncrementalDetokenizer(tok, stop, skip_special_tokens=skip_special)
        slow = IncrementalDetokenizer(CountingTokenizer(tok), stop, skip_special_tokens=skip_special)
        assert fast._concat and not slow._concat
        for piece in chunks(ids, rng) if rng.random() < 0.3 else ([i] for i in ids):
            assert fast.add(piece) == slow.add(piece), ids
        assert fast.flush() == slow.flush()
        assert (fast.text, fast.stopped, fast.stop_string) == (slow.text, slow.stopped, slow.stop_string)


def test_byte_level_shortcut_calls_the_tokenizer_once_per_distinct_token(tok):
    ascii_ids = tok.encode(" ".join([TEXTS[2]] * 20))
    counter = ConcatCountingTokenizer(tok)
    pieces, tail = stream(IncrementalDetokenizer(counter, []), ascii_ids)
    assert "".join(pieces) + tail == tok.decode(ascii_ids)
    assert counter.window_lengths == [1] * len(set(ascii_ids))   # then each id's text comes from the cache
    # Unfinished characters take the window path, and still cost fewer calls than the window path alone.
    ids = tok.encode(" ".join(TEXTS * 5))
    fast, slow = ConcatCountingTokenizer(tok), CountingTokenizer(tok)
    assert stream(IncrementalDetokenizer(fast, []), ids) == stream(IncrementalDetokenizer(slow, []), ids)
    assert len(fast.window_lengths) < len(slow.window_lengths)

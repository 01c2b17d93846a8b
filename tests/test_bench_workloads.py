"""Reference workloads reproduce docs/architecture.md section 6 exactly and deterministically; YAML files are
validated; workloads fit smaller models."""
import pytest

from minillm.bench.workloads import (REFERENCE_INPUT_TOKENS, REFERENCE_OUTPUT_TOKENS, check_reference_totals,
                                     load_workload, offline_workload, online_workload, reference_offline)


def test_offline_reference_totals():
    w = reference_offline()
    assert w.num_requests == 256
    assert (w.input_tokens, w.output_tokens) == (REFERENCE_INPUT_TOKENS, REFERENCE_OUTPUT_TOKENS) == (142_827, 133_966)
    assert all(100 <= len(p) <= 1024 and 100 <= m <= 1024 for p, m in zip(w.prompts, w.max_tokens))
    assert all(0 <= t <= 10000 for p in w.prompts for t in p)
    assert w.temperature == 0.6 and w.max_model_len == 2048
    check_reference_totals(w)


def test_offline_is_deterministic_and_head_is_a_prefix():
    a, b = reference_offline(), reference_offline()
    assert a.prompts == b.prompts and a.max_tokens == b.max_tokens
    h = a.head(4)
    assert h.prompts == a.prompts[:4] and h.max_tokens == a.max_tokens[:4]
    with pytest.raises(RuntimeError, match="drifted"):
        check_reference_totals(h)
    with pytest.raises(ValueError, match="num_requests"):
        a.head(0)
    with pytest.raises(ValueError, match="num_requests"):
        a.head(257)


def test_offline_rejects_lengths_past_max_model_len():
    with pytest.raises(ValueError, match="max_model_len"):
        offline_workload(num_requests=2, prompt_len=(10, 100), output_len=(10, 100), max_model_len=150)
    with pytest.raises(ValueError, match="prompt_len"):
        offline_workload(num_requests=2, prompt_len=(50, 10))


def test_online_reference_shape_and_determinism():
    w = online_workload()
    assert w.num_requests == 240 and w.max_model_len == 8192
    lens = [len(p) for p in w.prompts]
    long = [n for n in lens if n >= 4096]
    assert len(long) == 24 and all(n <= 7680 for n in long)
    assert all(128 <= n <= 512 for n in lens if n < 4096)
    assert all(128 <= m <= 256 for m in w.max_tokens)
    arr4, arr8 = w.arrivals(4.0), w.arrivals(8.0)
    assert arr4 == sorted(arr4) and arr8[-1] == pytest.approx(arr4[-1] / 2)
    # mean gap of a rate-4 Poisson process is 0.25 s; 240 draws land well within +-30%
    assert 0.175 < arr4[-1] / 240 < 0.325
    again = online_workload()
    assert again.prompts == w.prompts and again.unit_arrivals == w.unit_arrivals
    assert online_workload(seed=1).unit_arrivals != w.unit_arrivals
    with pytest.raises(ValueError, match="rate"):
        w.arrivals(0)


def test_yaml_workload(tmp_path):
    path = tmp_path / "small.yaml"
    path.write_text("kind: offline\nnum_requests: 5\nprompt_len: [4, 8]\noutput_len: [2, 3]\nmax_model_len: 64\n")
    w = load_workload(path)
    assert w.name == "small" and w.num_requests == 5
    assert all(4 <= len(p) <= 8 for p in w.prompts) and all(2 <= m <= 3 for m in w.max_tokens)
    path.write_text("kind: online\nnum_requests: 3\nbogus: 1\n")
    with pytest.raises(ValueError, match="bogus"):
        load_workload(path)
    path.write_text("kind: closed\n")
    with pytest.raises(ValueError, match="kind"):
        load_workload(path)
    with pytest.raises(ValueError, match="not found"):
        load_workload(tmp_path / "missing.yaml")


def test_salted_changes_only_first_tokens():
    w = reference_offline().head(3)
    s = w.salted(1)
    assert [len(p) for p in s.prompts] == [len(p) for p in w.prompts] and s.max_tokens == w.max_tokens
    assert all(a[0] != b[0] and a[1:] == b[1:] for a, b in zip(s.prompts, w.prompts))
    assert w.salted(0) is w


def test_fit_folds_ids_into_a_small_vocabulary_and_keeps_the_work():
    w = reference_offline().head(6)
    fitted, notes = w.fit(vocab_size=4096, max_len=2048)
    assert all(0 <= t < 4096 for p in fitted.prompts for t in p)
    assert [len(p) for p in fitted.prompts] == [len(p) for p in w.prompts] and fitted.max_tokens == w.max_tokens
    assert notes == ["token ids folded into the model's vocabulary of 4096"]
    assert fitted.summary()["fitted"] == {"vocab_size": 4096, "max_model_len": 2048}
    assert all(0 <= t < 4096 for p in fitted.salted(3).prompts for t in p)   # a later pass stays inside too


def test_fit_cuts_requests_to_a_shorter_model():
    w = online_workload(num_requests=40)
    fitted, notes = w.fit(vocab_size=151_936, max_len=2048)
    assert fitted.max_model_len == 2048 and len(notes) == 1 and "cut to fit" in notes[0]
    assert all(len(p) + m <= 2048 and len(p) >= 1 for p, m in zip(fitted.prompts, fitted.max_tokens))
    assert fitted.max_tokens == w.max_tokens                     # outputs are kept, prompts lose their end
    kept = [(a, b) for a, b in zip(w.prompts, fitted.prompts) if len(a) + 256 <= 2048]
    assert kept and all(a == b for a, b in kept)
    assert fitted.unit_arrivals == w.unit_arrivals


def test_fit_is_a_no_op_where_the_model_is_big_enough():
    w = reference_offline().head(2)
    assert w.fit(vocab_size=151_936, max_len=40_960) == (w, [])


@pytest.mark.parametrize("text, words", [
    ("num_requests: 1000000000\n", "num_requests=1000000000"),
    ("prompt_len: 5\n", "prompt_len=5"),
    ("max_model_len: x\n", "max_model_len='x'"),
    ("seed: [1]\n", "seed=[1]"),
    ("temperature: .inf\n", "temperature=inf"),
    ("kind: online\nlong_fraction: yes\n", "long_fraction=True"),
    ("name: [1]\n", "name=[1]"),
    ("num_requests: 100000\nprompt_len: [1, 100000]\nmax_model_len: 200000\n", "the limit is 50,000,000"),
])
def test_hostile_workload_files_are_refused(tmp_path, text, words):
    path = tmp_path / "w.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        load_workload(path)
    assert words in str(e.value)

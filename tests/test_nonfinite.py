"""A checkpoint whose logits are NaN: answers stay valid JSON (NaN logprobs as null), the engine warns once, and
the other lines are answered; -inf logprobs are written as the documented sentinel."""
import io
import json
import logging
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from minillm.serve.generate_jsonl import NEG_INF_LOGPROB, json_logprob, run_generate
from tiny_models import make_tiny_checkpoint


def _strict(text: str):
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"bare {name} in the output"))


@pytest.fixture(scope="module")
def nan_llm(tmp_path_factory):
    from minillm import LLM
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("nan") / "m", "qwen3")
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = torch.full_like(tensors["model.norm.weight"], math.nan)
    save_file(tensors, path / "model.safetensors")
    return LLM(str(path), device="cpu", max_num_seqs=4, max_model_len=64, num_kv_blocks=32)


def test_nan_logits_give_valid_json_and_a_warning(nan_llm, caplog):
    lines = [(1, b'{"id": "lp", "prompt_token_ids": [1, 2, 3], "logprobs": 2, "max_tokens": 2}'),
             (2, b'{"id": "plain", "prompt_token_ids": [4, 5], "max_tokens": 2}')]
    out = io.BytesIO()
    with caplog.at_level(logging.WARNING, logger="minillm"):
        run_generate(nan_llm, lines, {"temperature": 0.0}, out, progress=False)
    got = [_strict(line) for line in out.getvalue().decode().splitlines()]
    assert [a["id"] for a in got] == ["lp", "plain"]
    assert all(lp["logprob"] is None for lp in got[0]["logprobs"])
    assert all(v is None for lp in got[0]["logprobs"] for v in lp["top"].values())
    assert "logits hold NaN or inf" in caplog.text


def test_http_logprobs_of_nan_logits_are_null(nan_llm):
    from fastapi.testclient import TestClient

    from minillm.serve.http.app import create_app
    from minillm.serve.http.settings import ServerSettings
    with TestClient(create_app(nan_llm, {"temperature": 0.0}, ServerSettings("m"))) as client:
        r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2, "logprobs": 1})
        assert r.status_code == 200, r.text
        assert _strict(r.text)["choices"][0]["logprobs"]["token_logprobs"] == [None, None]
        with client.stream("POST", "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "logprobs": 1,
                                                            "stream": True}) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: {")]
        assert events and all(v is None for e in events for v in _strict(e)["choices"][0]["logprobs"]
                              ["token_logprobs"])


def test_json_logprob_sentinels():
    assert json_logprob(-1.5) == -1.5
    assert json_logprob(-math.inf) == NEG_INF_LOGPROB == -9999.0
    assert json_logprob(math.nan) is None and json_logprob(math.inf) is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_nonfinite_watch_warns_once_and_not_for_finite_logits(device, caplog):
    from minillm.sampling.sampler import NonFiniteWatch
    watch, good = NonFiniteWatch(), torch.zeros(4, 32, device=device)
    watch.GPU_EVERY = 1   # check every step (the engine checks every 64th on a GPU)
    with caplog.at_level(logging.WARNING, logger="minillm"):
        for _ in range(3):
            watch.check(good)
        if device == "cuda":
            torch.cuda.synchronize()
            watch.check(good)
        assert not watch.seen and "NaN" not in caplog.text
        bad = good.clone()
        bad[2, 5] = math.nan
        for _ in range(3):   # on the GPU the flag is read a step later
            watch.check(bad)
            if device == "cuda":
                torch.cuda.synchronize()
        assert watch.seen and caplog.text.count("logits hold NaN or inf") == 1
    inf = torch.zeros(2, 8)
    inf[0, 0] = math.inf
    watch = NonFiniteWatch()
    watch.check(inf)
    assert watch.seen   # +inf is as broken as NaN

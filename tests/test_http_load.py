"""`minillm latency-sweep --target URL`: the online workload replayed over HTTP against a real `minillm serve`,
writing rows with the in-process sweep's keys (plus transport, target and the server's name), and failing loudly
on a dead target."""
import socket

import pytest
from typer.testing import CliRunner

from http_server import ServerProcess
from minillm.bench.report import LATENCY_KEYS, read_jsonl
from minillm.commands import app

# token ids below the demo model's 4,096-token vocabulary; lengths inside its max_model_len
ONLINE = ("kind: online\nnum_requests: 8\nshort_prompt_len: [8, 24]\nlong_prompt_len: [60, 90]\n"
          "output_len: [3, 6]\nmax_token_id: 4000\nmax_model_len: 128\nseed: 7\n")


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess()
    yield srv
    srv.stop()


def _invoke(*args, code: int = 0):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == code, result.output + repr(result.exception)
    return result


def test_target_sweep_writes_rows_like_the_in_process_sweep(server, tmp_path):
    wl = tmp_path / "online.yaml"
    wl.write_text(ONLINE)
    out, png = tmp_path / "lat.jsonl", tmp_path / "lat.png"
    common = ["--workload", wl, "--rates", "4,8", "--time-scale", 0.05, "--configs", "chunked-2048",
              "--output", out, "--plot", png, "--no-progress"]
    _invoke("latency-sweep", "--target", server.url, *common)
    assert png.read_bytes()[:4] == b"\x89PNG"
    http = read_jsonl(out)
    expected = http[0]["workload"]["output_tokens"]
    assert expected > 0 and [ln["rate"] for ln in http] == [4.0, 8.0]
    for ln in http:
        assert set(LATENCY_KEYS) <= set(ln) and ln["transport"] == "http"
        assert ln["engine"] == "minillm" and ln["served_model"] == "minillm-demo" and ln["target"] == server.url
        assert ln["requests_failed"] == 0 and ln["problems"] == []
        assert ln["output_tokens"] == ln["usage_output_tokens"] == expected
        assert 0 < ln["ttft_p50_s"] <= ln["ttft_p99_s"] and ln["itl_p50_s"] <= ln["itl_max_s"]
        assert ln["label"] == "chunked-2048" and ln["budget"] == 2048 and ln["chunked"] is True
        assert 0 < ln["server_admission_mean_s"] < ln["server_ttft_mean_s"]
        assert 0 <= ln["client_send_lag_p50_s"] <= ln["client_send_lag_max_s"]
        assert ln["config"]["scheduler"]["max_num_batched_tokens"] == 2048   # the named suite entry, resolved


def test_unreachable_target_fails_with_a_message(tmp_path):
    with socket.socket() as s:   # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    wl = tmp_path / "online.yaml"
    wl.write_text(ONLINE)
    result = _invoke("latency-sweep", "--target", f"http://127.0.0.1:{port}", "--workload", wl, "--rates", "4",
                     "--output", tmp_path / "lat.jsonl", "--no-progress", code=1)
    assert "cannot reach" in result.output
    assert not (tmp_path / "lat.jsonl").exists()


def test_target_with_several_configs_is_a_usage_error(tmp_path):
    result = _invoke("latency-sweep", "--target", "http://127.0.0.1:9", "--configs", "chunked-512,chunked-1024",
                     "--output", tmp_path / "lat.jsonl", code=2)
    assert "at most one config" in result.output


def test_request_body_samples_like_the_in_process_replay():
    """The server fills unset fields from its sampling defaults (top_p 0.9 out of the box): the replay's body must
    set every field the in-process run relies on, or the two transports time different sampler work."""
    from minillm.bench.http_load import _body
    from minillm.config_loader import SAMPLING_DEFAULTS
    from minillm.sampling_params import SamplingParams
    from minillm.serve.http.protocol import CompletionRequest, sampling_params

    body = _body("m", [1, 2, 3], 7, 0.6, stream=True)
    body.pop("stream_options")
    served, _ = sampling_params(CompletionRequest(**body), dict(SAMPLING_DEFAULTS))
    local = SamplingParams(temperature=0.6, max_tokens=7, ignore_eos=True)
    for field in ("temperature", "top_p", "top_k", "min_p", "max_tokens", "ignore_eos", "seed",
                  "presence_penalty", "frequency_penalty", "repetition_penalty"):
        assert getattr(served, field) == getattr(local, field), field

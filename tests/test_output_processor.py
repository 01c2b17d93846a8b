"""OutputProcessor on hand-made core outputs: the inline path of the common row (one token of completion 0)
and the general path give the same streamed outputs, stop strings end a completion on either path."""
import pytest
from test_tokenizer import write_tokenizer_dir

from minillm.detokenizer import IncrementalDetokenizer
from minillm.engine.output_processor import OutputProcessor
from minillm.engine.outputs import CoreOutput
from minillm.sampling_params import SamplingParams
from minillm.tokenizer import Tokenizer


class Prompts:
    def __init__(self, tok):
        self.tok = tok

    def detokenizer(self, params):
        return IncrementalDetokenizer(self.tok, list(params.stop))

    def decode(self, ids):
        return self.tok.decode(ids)


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(write_tokenizer_dir(tmp_path_factory.mktemp("tok")))


def run(tok, params, stream, ids, lps=False):
    """Feed `ids` one token a step to one request; returns its StepOutputs and what the engine must stop."""
    proc = OutputProcessor(Prompts(tok))
    proc.add("r", [1, 2], params, stream, ["r"], [])
    outs, stopped = [], []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        done = proc.process([CoreOutput("r", [t], "length" if last else None, {"lp": i} if lps else None, 3)])
        outs += done.outputs
        stopped += done.stopped
        if "r" not in proc:
            break
    return outs, stopped


@pytest.mark.parametrize("stream", [True, False])
def test_streamed_deltas_and_final_output(tok, stream):
    ids = tok.encode("the quick brown fox")
    outs, stopped = run(tok, SamplingParams(max_tokens=len(ids)), stream, ids)
    assert [o.new_token_ids for o in outs] == [[t] for t in ids] and not stopped
    assert [o.finished for o in outs] == [False] * (len(ids) - 1) + [True]
    assert "".join(o.new_text for o in outs) == ("the quick brown fox" if stream else "")
    final = outs[-1].output
    assert final.outputs[0].text == "the quick brown fox" and final.outputs[0].token_ids == ids
    assert final.outputs[0].finish_reason == "length" and final.num_cached_tokens == 3
    m = final.metrics
    assert len(m.token_times) == len(ids) and m.first_token_time == m.token_times[0] <= m.finished_time


@pytest.mark.parametrize("lps", [False, True])    # logprobs take the general path every step
def test_stop_string_ends_the_completion(tok, lps):
    ids = tok.encode("the quick brown fox jumps")
    params = SamplingParams(max_tokens=99, stop=["brown"], logprobs=0 if lps else None)
    outs, stopped = run(tok, params, True, ids, lps=lps)
    assert stopped == ["r"]
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert "".join(o.new_text for o in outs) == "the quick " == outs[-1].output.outputs[0].text
    assert len(outs) == len(tok.encode("the quick brown"))     # nothing after the stop string's last token
    if lps:
        assert outs[-1].output.outputs[0].logprobs == [{"lp": i} for i in range(len(outs))]

"""minillm: a small, fast inference engine for Qwen3 / Qwen2."""
from minillm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name):
    # Lazy so that `import minillm` (and the CLI's --help) does not pay for torch.
    if name == "LLM":
        from minillm.llm import LLM
        return LLM
    raise AttributeError(name)

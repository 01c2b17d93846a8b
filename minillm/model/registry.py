"""Maps config.json `architectures` names to the model class that implements them."""
from __future__ import annotations

from minillm.config import ConfigError
from minillm.model.arch import SUPPORTED_ARCHITECTURES
from minillm.model.qwen3 import QwenForCausalLM
from minillm.model.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[QwenForCausalLM]] = {
    "Qwen3ForCausalLM": QwenForCausalLM,
    "Qwen2ForCausalLM": QwenForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}
# NOTE: ModelArchConfig validates against SUPPORTED_ARCHITECTURES; the two lists must name the same models.
assert set(MODEL_REGISTRY) == set(SUPPORTED_ARCHITECTURES)


def get_model_class(architecture: str) -> type[QwenForCausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ConfigError(f"architecture {architecture!r} is not supported; supported: "
                          f"{', '.join(MODEL_REGISTRY)}") from None

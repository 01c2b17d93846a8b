"""Shared pytest setup: GPU tests carry @pytest.mark.gpu and skip cleanly where CUDA is absent."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny random Qwen3 checkpoint with the demo model's tokenizer (text prompts, chat template)."""
    from tiny_models import make_tiny_checkpoint, with_demo_tokenizer
    return with_demo_tokenizer(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), vocab=4096))


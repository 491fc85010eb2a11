"""Shared fixtures. Tests run inside a venv built by `make setup` for one SGLang release."""

import json
import os

import pytest

from sglang_disagg_ext import releases

# A 2-layer llama config is all ServerArgs needs on CPU (no weights are read).
TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}


@pytest.fixture(scope="session")
def policy():
    return releases.current_policy()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    return str(path)


@pytest.fixture
def clean_activation():
    """Undo any -ext activation a test performs in this process."""
    from sglang_disagg_ext import registration

    saved = os.environ.pop(registration.SELECTED_BACKEND_ENV, None)
    yield registration
    registration.deactivate()
    os.environ.pop(registration.SELECTED_BACKEND_ENV, None)
    if saved is not None:
        os.environ[registration.SELECTED_BACKEND_ENV] = saved

"""scripts/tiny_model.py: a model folder SGLang and transformers load without any download."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "model"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "tiny_model.py"), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.timeout(120)
def test_folder_holds_config_and_tokenizer_only(tiny):
    names = sorted(p.name for p in tiny.iterdir())
    assert "config.json" in names and "tokenizer.json" in names and "tokenizer_config.json" in names
    assert not any(n.endswith((".safetensors", ".bin")) for n in names)  # weights come from --load-format dummy
    config = json.loads((tiny / "config.json").read_text())
    assert config["vocab_size"] == 128
    assert config["hidden_size"] // config["num_attention_heads"] == 64


@pytest.mark.timeout(120)
def test_tokenizer_is_character_level_and_covers_the_vocab(tiny):
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny))
    assert len(tok) == AutoConfig.from_pretrained(str(tiny)).vocab_size == 128
    # ids by hand: 4 specials (0-3), "\n" = 4, then chr(32 + k) = 5 + k
    assert tok.encode("Hi 7\n", add_special_tokens=False) == [5 + 72 - 32, 5 + 105 - 32, 5, 5 + 55 - 32, 4]
    text = "Question: 12 * 3?\nAnswer: 36"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 3)
    assert tok.convert_ids_to_tokens(127) == "<extra_27>"


@pytest.mark.timeout(200)
def test_sglang_own_tokenizer_loader_reads_it(tiny):
    loader = None
    for module in ("sglang.srt.utils.hf_transformers_utils", "sglang.srt.hf_transformers_utils"):
        try:
            loader = __import__(module, fromlist=["get_tokenizer"]).get_tokenizer
            break
        except (ImportError, AttributeError):
            continue
    assert loader is not None, "no get_tokenizer in this SGLang release"
    tok = loader(str(tiny))
    assert tok.decode(tok.encode("ab", add_special_tokens=False)) == "ab"
    assert tok.eos_token_id == 2


@pytest.mark.timeout(300)
def test_with_weights_is_reproducible_and_generates_in_vocab(tmp_path):
    import hashlib

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    digests = []
    for name in ("a", "b"):
        done = subprocess.run([sys.executable, str(ROOT / "scripts" / "tiny_model.py"), "--with-weights",
                               str(tmp_path / name)], capture_output=True, text=True, timeout=200)
        assert done.returncode == 0, done.stderr
        digests.append(hashlib.sha256((tmp_path / name / "model.safetensors").read_bytes()).hexdigest())
    assert digests[0] == digests[1]  # seed 0: PD and colocated servers load identical weights
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "a"))
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    ids = tok("Question: 2+2?", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    assert len(new) == 6 and all(0 <= t < 128 for t in new)

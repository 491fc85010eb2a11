"""Write a tiny Llama model folder (config + hand-built tokenizer, no weights, no downloads).

    python scripts/tiny_model.py /tmp/tiny-llama

With ``--with-weights`` it also holds random weights (seed 0); without, SGLang
serves it with ``--load-format dummy`` (weights filled from a fixed seed,
so two servers with the same TP size hold the same weights). The tokenizer is
character level: ``<unk>``, ``<s>``, ``</s>``, ``<pad>``, newline and the 95
printable ASCII characters, padded with ``<extra_N>`` tokens to exactly
``VOCAB_SIZE`` so every id the model can emit decodes. Shapes suit the common
CUDA attention kernels (head dim 64).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

VOCAB_SIZE = 128
SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
    "torch_dtype": "bfloat16",
}


def vocab() -> dict:
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    tokens = list(SPECIALS) + chars
    tokens += [f"<extra_{i}>" for i in range(VOCAB_SIZE - len(tokens))]
    return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab=vocab(), unk_token="<unk>"))
    # One token per character; decoding joins them back without separators.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIALS))
    return tok


# Standard deviation of the random weights. At transformers' default (0.02) two layers
# barely move the residual stream: greedy output is nearly a bigram chain (one token
# repeated on most prompts), so tokens hardly depend on the KV of earlier positions.
# At 0.2 attention is sharp and 24 greedy tokens of six prompts held 19-23 distinct ids
# (0.02: 1-5), so a wrong KV byte shows in the tokens.
WEIGHT_STD = 0.2


def write_weights(out: Path, seed: int = 0) -> None:
    """Random bf16 weights (transformers' own init, std ``WEIGHT_STD``, fixed seed) as model.safetensors.

    ``--load-format dummy`` fills every parameter uniformly in [-1e-3, 1e-3], so
    logits are nearly flat and a corrupted KV transfer can go unnoticed; these
    weights make the generated tokens depend on the transferred KV.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = {k: v for k, v in CONFIG.items() if k != "architectures"}
    model = LlamaForCausalLM(LlamaConfig(**config, initializer_range=WEIGHT_STD))
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    # save_pretrained rewrites config.json; keep the hand-written one.
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")


def write_tiny_model(folder, with_weights: bool = False) -> Path:
    from transformers import PreTrainedTokenizerFast

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    if with_weights:
        write_weights(out)
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(),
        unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=CONFIG["max_position_embeddings"],
    )
    fast.save_pretrained(str(out))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}, indent=2) + "\n"
    )
    return out


def main(argv=None) -> int:
    from sglang_disagg_ext.help_text import plain_text  # --help shows the docstring without its RST markup

    parser = argparse.ArgumentParser(prog="tiny_model", description=plain_text(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="output folder (created if missing)")
    parser.add_argument("--with-weights", action="store_true",
                        help="also write random weights (model.safetensors, seed 0) instead of relying on "
                             "--load-format dummy")
    args = parser.parse_args(argv)
    out = write_tiny_model(args.folder, with_weights=args.with_weights)
    how = "load it normally" if args.with_weights else "serve it with --load-format dummy"
    print(f"tiny model written to {out} (vocab {VOCAB_SIZE}, {CONFIG['num_hidden_layers']} layers); {how}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

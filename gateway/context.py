"""The context-length check: a call whose prompt plus ``max_tokens`` exceeds the server's
``max_model_len`` is answered by the gateway itself, before any inference server sees it.

vLLM would refuse it too, with a 400 whose wording changes between versions; an agent (and
the rollout controller, ``controller.on_context_overflow``) needs one stable answer to act
on: OpenAI's 400 with code ``context_length_exceeded``, naming both lengths. The prompt is
counted as vLLM counts it: the served model's tokenizer and chat template (tools included),
loaded once per gateway process; a call whose bytes alone show that it fits (most calls)
is not rendered or tokenized. A 400 of vLLM's own about the context length (a count
that differs at the margin, an endpoint the check does not cover) gets the same code.

The rollout's record counts its overflowing calls (``RolloutRecord.context_overflow``),
which the rollout worker reads when the agent ends.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.bodies import Request
from gateway.rendering import TemplateInput, extra_template_inputs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

# how vLLM words its own refusal (``vllm/entrypoints/openai/engine/serving.py``)
VLLM_PHRASES = ("maximum context length", "max_model_len")


def is_vllm_overflow(status: int, message: str) -> bool:
    return status == 400 and any(p in message for p in VLLM_PHRASES)


def served_tokenizer(tokenizer_path: Path, chat_template: str | None = None
                     ) -> PreTrainedTokenizerBase:
    """The served model's tokenizer, with the chat template the servers render with
    (``inference.chat_template``, else the model's own)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    if chat_template:
        tokenizer.chat_template = Path(chat_template).read_text()
    tokenizer.model_max_length = 1 << 30  # counting long prompts is the point
    return tokenizer


class ContextCheck:
    """Counts a request's prompt tokens with the served model's tokenizer."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.template_input = TemplateInput(tokenizer)
        self.fixed_bytes, self.message_bytes = self._template_overhead()

    def _template_overhead(self) -> tuple[int, int]:
        """What the chat template adds around the contents, in bytes: once (a default
        system prompt, the generation prompt) and per message, each measured on empty
        messages and doubled for safety. None when it cannot be measured."""
        def size(roles: list[str]) -> int:
            text = self.tokenizer.apply_chat_template(
                [{"role": r, "content": ""} for r in roles], add_generation_prompt=True,
                tokenize=False)
            return len(str(text).encode())

        try:
            one = max(size([r]) for r in ("user", "system"))
            per = max(size(["user", r]) - size(["user"]) for r in ("user", "assistant",
                                                                  "system"))
        except Exception:  # noqa: BLE001 - a template without these roles: always count
            return 1 << 30, 1 << 30
        return 2 * one, 2 * max(per, 1)

    def surely_fits(self, body: Request, max_tokens: int) -> bool:
        """A bound that needs no tokenizer: a token stands for at least one byte of the
        rendered text (byte-level BPE, characters, SentencePiece with byte fallback), so a
        chat whose contents plus the template's measured overhead have fewer bytes than
        the room left fits. Tools and other template inputs are always counted."""
        if body.get("tools") or extra_template_inputs(body):
            return False
        size = self.fixed_bytes + 16
        for m in body["messages"]:
            content = m.get("content")
            if isinstance(content, list):
                texts = [p.get("text", "") if isinstance(p, dict) else p for p in content]
                if not all(isinstance(t, str) for t in texts):
                    return False
                content = "\n".join(texts)
            if content is not None and not isinstance(content, str):
                return False
            if m.get("tool_calls") or set(m) - {"role", "content", "name"}:
                return False
            size += self.message_bytes + len((content or "").encode()) \
                + len(str(m.get("name") or "").encode())
        return size + max_tokens <= self.max_model_len

    def prompt_tokens(self, body: Request, endpoint: str) -> int:
        if endpoint == "chat.completions":
            ids = self.tokenizer.apply_chat_template(
                self.template_input(body["messages"]), tools=body.get("tools"),
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                continue_final_message=bool(body.get("continue_final_message", False)),
                tokenize=True, return_dict=False, **extra_template_inputs(body))
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

    def check(self, body: Request, endpoint: str,
              prompt_ids: list[int] | None = None) -> tuple[int, int] | None:
        """``None`` when the call fits, else (prompt tokens, max_tokens). ``body`` is the
        upstream body (its ``max_tokens`` filled in); ``prompt_ids``: the prompt already
        known as token ids (token continuity), counted instead of rendering."""
        # vLLM's chat endpoint takes max_completion_tokens first
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 0)
        if prompt_ids is not None:
            return None if len(prompt_ids) + max_tokens <= self.max_model_len \
                else (len(prompt_ids), max_tokens)
        if endpoint == "chat.completions" and self.surely_fits(body, max_tokens):
            return None  # most calls: no rendering, no tokenizing
        if endpoint == "completions" and isinstance(body["prompt"], str) \
                and len(body["prompt"].encode()) + 16 + max_tokens <= self.max_model_len:
            return None
        try:
            prompt = self.prompt_tokens(body, endpoint)
        except Exception as exc:  # noqa: BLE001 - a template that fails here fails in vLLM
            log.info("context check skipped: the prompt could not be counted (%s: %s)",
                     exc.__class__.__name__, exc)
            return None
        return None if prompt + max_tokens <= self.max_model_len else (prompt, max_tokens)

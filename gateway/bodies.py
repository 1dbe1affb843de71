"""The JSON bodies the gateway reads and writes on its vLLM side: OpenAI chat completions
and completions, with vLLM's token-id fields (``return_token_ids``).

Every class is ``total=False``: a body is what the agent or the server sent, and the gateway
reads each field with ``.get`` and checks what it relies on (``gateway.forward``'s
validation, ``gateway.body``). A body is a plain dict at run time, and keeps fields named
nowhere here (vLLM's sampling extensions pass through as they came). One shape serves chat
and completions where the gateway handles both alike: a completions choice has ``text``
where a chat choice has ``message``, a streamed chunk's choice ``delta``.
"""

from __future__ import annotations

from typing import TypedDict


class TextPart(TypedDict, total=False):
    """A part of a message's content: the gateway takes text parts only."""

    type: str
    text: str


class FunctionCall(TypedDict, total=False):
    name: str | None
    arguments: str


class ToolCall(TypedDict, total=False):
    """A tool call of an assistant message (``index``: its place, in a streamed delta)."""

    index: int
    id: str | None
    type: str
    function: FunctionCall


class Message(TypedDict, total=False):
    """A chat message of a request (its content may be in parts)."""

    role: str
    content: str | list[TextPart | str] | None
    name: str
    tool_calls: list[ToolCall] | None
    tool_call_id: str
    reasoning: str | None
    reasoning_content: str | None


class AnswerMessage(TypedDict, total=False):
    """The message of an answer's choice, or a streamed chunk's delta of one."""

    role: str
    content: str | None
    tool_calls: list[ToolCall] | None
    reasoning: str | None
    reasoning_content: str | None


class Function(TypedDict, total=False):
    """A tool's function. Its schema, description and ``strict`` go on as the agent sent
    them: vLLM checks them."""

    name: str
    description: object
    parameters: object
    strict: object


class Tool(TypedDict, total=False):
    """A chat-completions tool (a function's name and JSON schema)."""

    type: str
    function: Function


class FunctionName(TypedDict):
    name: str


class NamedToolChoice(TypedDict):
    """A ``tool_choice`` that forces one function."""

    type: str
    function: FunctionName


class TokenLogprob(TypedDict, total=False):
    token: str
    logprob: float | None
    bytes: list[int] | None
    top_logprobs: list[TokenLogprob]


class Logprobs(TypedDict, total=False):
    """A choice's log-probs: chat's ``content``, or completions' parallel lists."""

    content: list[TokenLogprob] | None
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class Choice(TypedDict, total=False):
    """One choice of an answer or of a streamed chunk, with vLLM's token ids."""

    index: int
    message: AnswerMessage
    delta: AnswerMessage
    text: str
    logprobs: Logprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    token_ids: list[int] | None
    prompt_token_ids: list[int] | None


class Usage(TypedDict, total=False):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Answer(TypedDict, total=False):
    """A chat or completions answer, or one chunk of a streamed answer."""

    id: str
    object: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None
    prompt_token_ids: list[int] | None
    error: dict[str, object]


class StreamOptions(TypedDict, total=False):
    include_usage: bool
    continuous_usage_stats: bool


class KvTransferParams(TypedDict, total=False):
    """vLLM's pass-through field; the gateway sends a prompt's token ids in it (token
    continuity, a carried-on call)."""

    prompt_token_ids: list[int]


class Request(TypedDict, total=False):
    """A chat or completions request as the gateway forwards it."""

    model: str
    messages: list[Message]
    prompt: str | list[str] | list[int] | list[list[int]]
    n: int
    stream: bool
    stream_options: StreamOptions
    echo: bool
    max_tokens: int | None
    max_completion_tokens: int | None
    stop: str | list[str] | None
    temperature: float | None
    # the sampling fields gateway.sampling holds to what the trainer models
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: dict[str, float]
    allowed_token_ids: list[int]
    bad_words: list[str]
    min_tokens: int
    logprobs: bool | int | None
    top_logprobs: int | None
    return_token_ids: bool
    include_reasoning: bool
    tools: list[Tool]
    tool_choice: str | NamedToolChoice
    parallel_tool_calls: bool
    response_format: dict[str, object]
    structured_outputs: dict[str, object]
    reasoning_effort: str
    chat_template_kwargs: dict[str, object]
    add_generation_prompt: bool
    continue_final_message: bool
    kv_transfer_params: KvTransferParams
    # vLLM's removed guided-decoding fields, which the gateway turns into structured_outputs
    guided_json: object
    guided_regex: object
    guided_choice: object
    guided_grammar: object
    guided_decoding_backend: object
    guided_whitespace_pattern: object

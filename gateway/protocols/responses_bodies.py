"""The JSON bodies the gateway writes on its Responses API side (``gateway.protocols.responses``):
a ``response`` object and its output items, which a stream's events also carry. The agent's
request is read as a plain JSON object and checked where it is read; the fields a response
echoes from it go back as the agent sent them."""

from __future__ import annotations

from typing import Literal, NotRequired, TypedDict


class OutputText(TypedDict):
    """A message item's text (an added part, still empty, has no ``logprobs`` yet)."""

    type: Literal["output_text"]
    text: str
    annotations: list[object]
    logprobs: NotRequired[list[object]]


class MessageItem(TypedDict):
    type: Literal["message"]
    id: str
    status: str
    role: Literal["assistant"]
    content: list[OutputText]


class FunctionCallItem(TypedDict):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str | None
    arguments: str
    status: str


OutputItem = MessageItem | FunctionCallItem


class InputTokensDetails(TypedDict):
    cached_tokens: int


class OutputTokensDetails(TypedDict):
    reasoning_tokens: int


class ResponseUsage(TypedDict):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(TypedDict):
    reason: str


class ResponseBody(TypedDict):
    """A ``response`` object: the whole answer, or a stream's snapshot of it."""

    id: str
    object: Literal["response"]
    created_at: int
    status: str
    model: str | None
    output: list[OutputItem]
    error: None
    incomplete_details: IncompleteDetails | None
    instructions: object
    metadata: object
    max_output_tokens: object
    parallel_tool_calls: object
    previous_response_id: None
    reasoning: None
    store: bool
    temperature: object
    top_p: object
    text: object
    tool_choice: object
    tools: object
    truncation: str
    usage: ResponseUsage

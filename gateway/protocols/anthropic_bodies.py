"""The JSON bodies the gateway writes on its Messages API side (``gateway.protocols.anthropic``):
an answer (a message and its content blocks), the events of a streamed one, and an error.
The agent's request is read as a plain JSON object and checked where it is read."""

from __future__ import annotations

from typing import Literal, TypedDict


class TextBlock(TypedDict):
    type: Literal["text"]
    text: str


class ToolUseBlock(TypedDict):
    """A tool call: its ``input`` is the call's arguments as a JSON object."""

    type: Literal["tool_use"]
    id: str | None
    name: str | None
    input: dict[str, object]


ContentBlock = TextBlock | ToolUseBlock


class MessageUsage(TypedDict):
    input_tokens: int
    output_tokens: int


class MessageBody(TypedDict):
    """An answer: a whole one, or the one a stream's ``message_start`` opens."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str | None
    content: list[ContentBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessageUsage


class ErrorDetail(TypedDict):
    type: str
    message: str


class ErrorBody(TypedDict):
    """An error: a refused call's body, and a stream's ``error`` event."""

    type: Literal["error"]
    error: ErrorDetail


class MessageStart(TypedDict):
    type: Literal["message_start"]
    message: MessageBody


class ContentBlockStart(TypedDict):
    type: Literal["content_block_start"]
    index: int
    content_block: ContentBlock


class TextDelta(TypedDict):
    type: Literal["text_delta"]
    text: str


class InputJsonDelta(TypedDict):
    type: Literal["input_json_delta"]
    partial_json: str


class ContentBlockDelta(TypedDict):
    type: Literal["content_block_delta"]
    index: int
    delta: TextDelta | InputJsonDelta


class ContentBlockStop(TypedDict):
    type: Literal["content_block_stop"]
    index: int


class StopDelta(TypedDict):
    stop_reason: str | None
    stop_sequence: str | None


class OutputUsage(TypedDict):
    output_tokens: int


class MessageDelta(TypedDict):
    type: Literal["message_delta"]
    delta: StopDelta
    usage: OutputUsage


class MessageStop(TypedDict):
    type: Literal["message_stop"]


Event = (MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop
         | MessageDelta | MessageStop | ErrorBody)

"""A tool-using agent, written five ways: with the ``openai`` chat API, the ``openai``
Responses API, the OpenAI Agents SDK, the ``anthropic`` Messages API and LangChain's
``ChatOpenAI``. Each asks "What is a + b?", has the model call an ``add`` tool (the tool
is named in ``tool_choice`` and marked strict: a small model seldom decides to call one by
itself, and vLLM then constrains the call and its arguments to the schema), runs it, and
lets the model answer with the tool's result in the conversation.

Reward: half for calling the tool with the question's numbers, half for a final answer
whose first number is the sum. ``max_tokens`` leaves room for the JSON whitespace a small
model writes inside a call (the grammar allows it): a call cut short is not run.
``sample["sdk"]`` (or the ``sdk`` setting) picks the client; nothing here knows about
carryover beyond the base URL and key it is given.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any

from app.client import openai_max_retries

NUMBER = re.compile(r"-?\d+")
SCHEMA = {"type": "object",
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["a", "b"], "additionalProperties": False}
DESCRIPTION = "Add two numbers."
SYSTEM = "You answer arithmetic questions. Use the add tool, then give the number."


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def add(a: int, b: int) -> str:
    return str(int(a) + int(b))


def first_number(text: str | None) -> int | None:
    match = NUMBER.search(text or "")
    return int(match.group()) if match else None


Episode = tuple[dict[str, Any], str | None]  # the tool's arguments, the final answer


def with_openai_chat(llm: Any, q: str, retries: int, max_tokens: int) -> Episode:
    import openai

    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=retries)
    tools = [{"type": "function", "function": {"name": "add", "description": DESCRIPTION,
                                               "parameters": SCHEMA, "strict": True}}]
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
    first = client.chat.completions.create(
        model=llm.model, messages=messages, tools=tools, max_tokens=max_tokens,
        tool_choice={"type": "function", "function": {"name": "add"}})
    if not first.choices[0].message.tool_calls:
        return {}, None  # no call (cut at max_tokens): no reward for it
    call = first.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": add(**args)}]
    final = client.chat.completions.create(model=llm.model, messages=messages, tools=tools,
                                           tool_choice="none", max_tokens=max_tokens)
    return args, final.choices[0].message.content


def with_openai_responses(llm: Any, q: str, retries: int, max_tokens: int) -> Episode:
    import openai

    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=retries)
    tools = [{"type": "function", "name": "add", "description": DESCRIPTION,
              "parameters": SCHEMA, "strict": True}]
    first = client.responses.create(model=llm.model, instructions=SYSTEM, input=q,
                                    tools=tools, max_output_tokens=max_tokens,
                                    tool_choice={"type": "function", "name": "add"})
    call = next((item for item in first.output if item.type == "function_call"), None)
    if call is None:
        return {}, None
    args = json.loads(call.arguments)
    final = client.responses.create(
        model=llm.model, instructions=SYSTEM, tools=tools, tool_choice="none",
        max_output_tokens=max_tokens,
        input=[{"role": "user", "content": q},
               {"type": "function_call", "call_id": call.call_id, "name": "add",
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id,
                "output": add(**args)}])
    return args, final.output_text


def with_openai_agents(llm: Any, q: str, retries: int, max_tokens: int) -> Episode:
    from agents import (
        Agent,
        MaxTurnsExceeded,
        ModelBehaviorError,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # it would export traces to OpenAI
    used: dict[str, Any] = {}

    @function_tool
    def add_numbers(a: int, b: int) -> str:
        """Add two numbers."""
        used.update(a=a, b=b)
        return add(a, b)

    async def episode() -> str | None:
        client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=retries)
        try:
            # the first turn must call the tool; the SDK then resets tool_choice to auto
            agent = Agent(name="adder", instructions=SYSTEM, tools=[add_numbers],
                          model=OpenAIResponsesModel(model=llm.model, openai_client=client),
                          model_settings=ModelSettings(tool_choice="required",
                                                       max_tokens=max_tokens))
            result = await Runner.run(agent, q, max_turns=3)
            return str(result.final_output)
        except (MaxTurnsExceeded, ModelBehaviorError):
            return None  # the model called the tool again, or ran past max_tokens
        finally:
            await client.close()  # inside the loop that opened it

    return used, asyncio.run(episode())


def with_anthropic(llm: Any, q: str, retries: int, max_tokens: int) -> Episode:
    import anthropic

    client = anthropic.Anthropic(base_url=llm.base_url.removesuffix("/v1"),
                                 api_key=llm.api_key, max_retries=retries)
    tools = [{"name": "add", "description": DESCRIPTION, "input_schema": SCHEMA,
              "strict": True}]
    messages: list[Any] = [{"role": "user", "content": q}]
    first = client.messages.create(model=llm.model, system=SYSTEM, messages=messages,
                                   tools=tools, max_tokens=max_tokens,
                                   tool_choice={"type": "tool", "name": "add"})
    use = next((block for block in first.content if block.type == "tool_use"), None)
    if use is None:
        return {}, None
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": add(**use.input)}]}]
    final = client.messages.create(model=llm.model, system=SYSTEM, messages=messages,
                                   tools=tools, tool_choice={"type": "none"},
                                   max_tokens=max_tokens)
    return dict(use.input), "".join(b.text for b in final.content if b.type == "text")


def with_langchain(llm: Any, q: str, retries: int, max_tokens: int) -> Episode:
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def add_numbers(a: int, b: int) -> str:
        """Add two numbers."""
        return add(a, b)

    chat = ChatOpenAI(model=llm.model, base_url=llm.base_url, api_key=llm.api_key,
                      max_tokens=max_tokens, max_retries=retries)
    history: list[Any] = [SystemMessage(SYSTEM), HumanMessage(q)]
    first = chat.bind_tools([add_numbers], tool_choice="add_numbers",
                            strict=True).invoke(history)
    if not first.tool_calls:
        return {}, None
    call = first.tool_calls[0]
    history += [first, ToolMessage(add_numbers.invoke(call["args"]), tool_call_id=call["id"])]
    # the same tools in the prompt: the answer turn continues the tool turn's tokens
    final = chat.bind_tools([add_numbers], tool_choice="none", strict=True).invoke(history)
    return dict(call["args"]), str(final.content)


SDKS: dict[str, Callable[[Any, str, int, int], Episode]] = {
    "openai-chat": with_openai_chat, "openai-responses": with_openai_responses,
    "openai-agents": with_openai_agents, "anthropic": with_anthropic,
    "langchain": with_langchain}


def run(sample: dict, llm: Any, *, sdk: str = "openai-chat", max_tokens: int = 96,
        **_: Any) -> float:
    name = str(sample.get("sdk", sdk))
    if name not in SDKS:
        raise ValueError(f"sdk {name!r} is not one of {', '.join(SDKS)}")
    a, b = int(sample["a"]), int(sample["b"])
    retries = openai_max_retries(getattr(llm, "max_wait_s", 900.0))
    args, answer = SDKS[name](llm, question(a, b), retries, max_tokens)
    called_right = {k: int(v) for k, v in args.items()} == {"a": a, "b": b}
    return 0.5 * called_right + 0.5 * (first_number(answer) == a + b)

"""Agents as they are written: the official SDKs, unmodified, through the real gateway to the
real vLLM CPU server of SmolLM2-135M-Instruct (with its tool-aware chat template and
vLLM's hermes tool-call parser). Each rollout's calls must be captured with token ids and
log-probs, whatever protocol the agent spoke.

A 135M model rarely decides to call a tool by itself, so the tool turns name the tool
(``tool_choice``) and mark it strict: vLLM then constrains the call's markup and its
arguments to the tool's schema (without ``strict`` only the markup), and the call is marked
constrained in the capture.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import requests

from app.state import keys
from app.state.records import CapturedCall
from tests.conftest import SMOLLM2 as MODEL
from tests.conftest import SMOLLM2_NAME as NAME
from tests.conftest import SMOLLM2_SERVING as SERVING
from tests.conftest import gateway_process

pytestmark = pytest.mark.slow

ADD_SCHEMA = {"type": "object",
              "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                             "b": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a", "b"], "additionalProperties": False}
QUESTION = "What is 3 + 4? Use the add tool."


@pytest.fixture(scope="module")
def gw(tmp_root, smollm2_server):
    with gateway_process(tmp_root, "gateway-sdks", [smollm2_server],
                         f"inference.served_model_name={NAME}",
                         f"actor_rollout_ref.model.path={MODEL}", *SERVING,
                         "actor_rollout_ref.rollout.max_tokens=24") as (url, _):
        yield url


def captured(redis_client, rid: str, calls: int | None = None) -> list[CapturedCall]:
    """The rollout's captured calls (``calls`` of them, when given), each whole."""
    got = [CapturedCall.from_json(c)
           for c in redis_client.lrange(keys.rollout_calls(rid), 0, -1)]
    assert len(got) == calls if calls is not None else got, [c.endpoint for c in got]
    for call in got:
        assert call.prompt_ids and call.response_ids
        assert len(call.logprobs) == len(call.response_ids) and call.nonfinite_logprobs == 0
        assert all(lp <= 0 for lp in call.logprobs)
    return got


def continues(first: CapturedCall, second: CapturedCall) -> None:
    """Token continuity: the second turn's prompt begins with the first call's prompt and
    sampled tokens (the tool grammar samples the call's markup in other pieces than the
    template renders: without continuity the prompts diverge), so the trainer packs both
    into one row."""
    assert second.continued and not first.continued
    head = first.prompt_ids + first.response_ids
    assert second.prompt_ids[:len(head)] == head


def prompt_text(call: CapturedCall) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL)).decode(call.prompt_ids)


def add(a: int, b: int) -> str:
    return str(a + b)


def test_openai_chat_with_a_tool_call_and_its_answer(gw, new_rollout, redis_client):
    from openai import OpenAI

    rid, token, base = new_rollout(gw)
    client = OpenAI(base_url=base, api_key=token, max_retries=2)
    tools = [{"type": "function", "function": {"name": "add", "description": "Add two digits",
                                               "parameters": ADD_SCHEMA, "strict": True}}]
    messages: list = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(
        model=NAME, messages=messages, tools=tools, max_tokens=96,
        tool_choice={"type": "function", "function": {"name": "add"}})
    call = first.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "add" and set(args) == {"a", "b"}
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": add(**args)}]
    second = client.chat.completions.create(model=NAME, messages=messages, tools=tools,
                                            tool_choice="none", max_tokens=12)
    assert second.choices[0].message.content is not None
    calls = captured(redis_client, rid, 2)
    assert calls[0].constrained == "tool_choice" and calls[1].constrained is None
    # the second turn's prompt holds the tool call and its result
    text = prompt_text(calls[1])
    assert "<tool_call>" in text and f"<tool_response>\n{add(**args)}\n</tool_response>" in text
    continues(calls[0], calls[1])


def test_openai_responses_plain_streamed_and_with_a_function_call(gw, new_rollout,
                                                                   redis_client):
    from openai import OpenAI

    rid, token, base = new_rollout(gw)
    client = OpenAI(base_url=base, api_key=token, max_retries=2)
    plain = client.responses.create(model=NAME, input="Say hello.", max_output_tokens=12,
                                    instructions="Answer briefly.")
    assert plain.status in ("completed", "incomplete") and plain.output_text
    events = list(client.responses.create(model=NAME, input="Say hello.",
                                          max_output_tokens=12, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",
                                                            "response.incomplete")
    assert "response.output_text.delta" in kinds
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == streamed
    tools = [{"type": "function", "name": "add", "description": "Add two digits",
              "parameters": ADD_SCHEMA, "strict": True}]
    first = client.responses.create(model=NAME, input=QUESTION, tools=tools,
                                    tool_choice={"type": "function", "name": "add"},
                                    max_output_tokens=96)
    fc = next(item for item in first.output if item.type == "function_call")
    args = json.loads(fc.arguments)
    second = client.responses.create(
        model=NAME, tools=tools, tool_choice="none", max_output_tokens=12,
        input=[{"role": "user", "content": QUESTION},
               {"type": "function_call", "call_id": fc.call_id, "name": "add",
                "arguments": fc.arguments},
               {"type": "function_call_output", "call_id": fc.call_id,
                "output": add(**args)}])
    assert second.output_text is not None
    calls = captured(redis_client, rid, 4)
    assert [c.stream for c in calls] == [False, True, False, False]
    assert calls[2].constrained == "tool_choice"
    assert f"<tool_response>\n{add(**args)}\n</tool_response>" in prompt_text(calls[3])


def test_the_openai_agents_sdk_runs_an_agent_with_a_function_tool(gw, new_rollout,
                                                                  redis_client):
    """examples/tools/agent.py's Agents SDK episode: the first turn must call the tool; the
    SDK then resets tool_choice to auto and sends the tool's output back for the answer."""
    from types import SimpleNamespace

    from examples.tools.agent import question, with_openai_agents

    rid, token, base = new_rollout(gw)
    llm = SimpleNamespace(base_url=base, api_key=token, model=NAME)
    used, _ = with_openai_agents(llm, question(3, 4), 2, 96)
    assert set(used) == {"a", "b"}, "the SDK ran the tool the model called"
    calls = captured(redis_client, rid)
    assert len(calls) >= 2 and calls[0].constrained == "tool_choice"
    # the SDK's second request carried the function_call and its output
    assert f"<tool_response>\n{add(**used)}\n</tool_response>" in prompt_text(calls[1])
    continues(calls[0], calls[1])


def test_a_structured_output_beside_strict_tools_leaves_a_call_or_an_answer_in_it(
        gw, new_rollout, redis_client):
    """An agent with an output type and strict tools (the OpenAI Agents SDK's defaults),
    tool_choice auto: the format is sent, and vLLM's hermes grammar offers the model a tool
    call or an answer in the format, never free text the SDK would fail to parse."""
    from openai import OpenAI

    rid, token, base = new_rollout(gw)
    client = OpenAI(base_url=base, api_key=token, max_retries=2)
    schema = {"type": "object", "properties": {"sum": {"type": "integer"}},
              "required": ["sum"], "additionalProperties": False}
    out = client.responses.create(
        model=NAME, input=QUESTION, max_output_tokens=48,
        tools=[{"type": "function", "name": "add", "description": "Add two digits",
                "parameters": ADD_SCHEMA, "strict": True}],
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                         "strict": True}})
    call = captured(redis_client, rid, 1)[0]
    assert call.constrained == "response_format"  # every token under the grammar
    calls = [o for o in out.output if o.type == "function_call"]
    if calls:
        assert set(json.loads(calls[0].arguments)) == {"a", "b"}
    elif out.status == "completed":
        assert isinstance(json.loads(out.output_text)["sum"], int)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_messages_with_a_tool_use_round_trip(gw, new_rollout, redis_client, stream):
    import anthropic

    rid, token, base = new_rollout(gw)
    client = anthropic.Anthropic(base_url=base.removesuffix("/v1"), api_key=token,
                                 max_retries=2)
    tools = [{"name": "add", "description": "Add two digits", "input_schema": ADD_SCHEMA,
              "strict": True}]
    messages: list = [{"role": "user", "content": QUESTION}]

    def create(**kw):
        if not stream:
            return client.messages.create(model=NAME, messages=messages, **kw)
        with client.messages.stream(model=NAME, messages=messages, **kw) as s:
            assert any(e.type == "content_block_delta" for e in s)
            return s.get_final_message()

    first = create(max_tokens=96, system="You add numbers.", tools=tools,
                   tool_choice={"type": "tool", "name": "add"})
    assert first.stop_reason == "tool_use"
    use = next(b for b in first.content if b.type == "tool_use")
    assert use.name == "add" and set(use.input) == {"a", "b"}
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": add(**use.input)}]}]
    second = create(max_tokens=12, system="You add numbers.", tools=tools)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert second.usage.input_tokens > 0 and second.usage.output_tokens > 0
    calls = captured(redis_client, rid, 2)
    assert all(c.stream == stream for c in calls)
    assert calls[0].constrained == "tool_choice"
    continues(calls[0], calls[1])
    assert f"<tool_response>\n{add(**use.input)}\n</tool_response>" in prompt_text(calls[1])


def test_langchain_chat_openai_with_a_tool(gw, new_rollout, redis_client):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    rid, token, base = new_rollout(gw)

    @tool
    def add_digits(a: int, b: int) -> str:
        """Add two digits."""
        return add(a, b)

    llm = ChatOpenAI(model=NAME, base_url=base, api_key=token, max_tokens=96, max_retries=2)
    history = [HumanMessage(QUESTION)]
    first = llm.bind_tools([add_digits], tool_choice="add_digits", strict=True).invoke(history)
    call = first.tool_calls[0]
    assert call["name"] == "add_digits"
    history += [first, ToolMessage(add_digits.invoke(call["args"]), tool_call_id=call["id"])]
    second = llm.invoke(history)
    assert isinstance(second.content, str)
    captured(redis_client, rid, 2)


def test_an_anthropic_prefill_is_continued_in_its_turn(gw, new_rollout, redis_client):
    """A last assistant message is continued: its text ends the prompt with no end of turn
    after it, and the answer is only what follows."""
    import anthropic

    rid, token, base = new_rollout(gw)
    client = anthropic.Anthropic(base_url=base.removesuffix("/v1"), api_key=token,
                                 max_retries=2)
    prefill = "The answer is"
    answer = client.messages.create(model=NAME, max_tokens=4, messages=[
        {"role": "user", "content": "What is 3 + 4?"},
        {"role": "assistant", "content": prefill}])
    assert answer.stop_reason in ("end_turn", "max_tokens")
    (call,) = captured(redis_client, rid, 1)
    assert prompt_text(call).rstrip().endswith(prefill)  # no <|im_end|>, no new turn


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_answer_asked_without_its_reasoning_is_still_captured_whole(gw, new_rollout,
                                                                       redis_client, stream):
    """vLLM leaves every token id and log-prob out of an answer whose reasoning is hidden
    (``include_reasoning: false``, with a tool-call parser): the gateway asks for it whole,
    captures it, and shows the agent the answer without reasoning."""
    rid, token, base = new_rollout(gw)
    answer = requests.post(f"{base}/chat/completions", headers={
        "Authorization": f"Bearer {token}"}, json={
        "model": NAME, "max_tokens": 6, "include_reasoning": False, "stream": stream,
        "messages": [{"role": "user", "content": QUESTION}]}, timeout=120)
    assert answer.status_code == 200, answer.text
    if stream:
        chunks = [json.loads(line[5:]) for line in answer.text.splitlines()
                  if line.startswith("data:") and line[5:].strip() != "[DONE]"]
        shown = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    else:
        shown = [answer.json()["choices"][0]["message"]]
    (call,) = captured(redis_client, rid, 1)
    assert len(call.response_ids) == 6 or call.finish_reason == "stop"
    assert not any("reasoning" in m or "reasoning_content" in m for m in shown)


def test_anthropic_errors_have_anthropics_shape(gw, new_rollout):
    import anthropic

    rid, token, base = new_rollout(gw)
    client = anthropic.Anthropic(base_url=base.removesuffix("/v1"), api_key=token,
                                 max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=NAME, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}}]}])
    assert bad.value.body["type"] == "error"
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[0]" in bad.value.body["error"]["message"]
    wrong = anthropic.Anthropic(base_url=base.removesuffix("/v1"), api_key="nope",
                                max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model=NAME, max_tokens=8,
                              messages=[{"role": "user", "content": "hi"}])


def test_each_sdk_lists_and_retrieves_the_served_model_in_its_own_shape(gw, new_rollout):
    """``models.list`` and ``models.retrieve`` of both SDKs (an agent checking its model
    first); the ``anthropic`` client reads a page of ``type: model`` entries, and errors
    in its shape."""
    import anthropic
    import openai

    rid, token, base = new_rollout(gw)
    oa = openai.OpenAI(base_url=base, api_key=token, max_retries=0)
    assert [m.id for m in oa.models.list().data] == [NAME]
    assert oa.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        oa.models.retrieve("other")
    an = anthropic.Anthropic(base_url=base.removesuffix("/v1"), api_key=token, max_retries=0)
    page = an.models.list()
    assert [(m.id, m.type) for m in page.data] == [(NAME, "model")] and not page.has_more
    assert an.models.retrieve(NAME).display_name == NAME
    with pytest.raises(anthropic.NotFoundError) as missing:
        an.models.retrieve("other")
    assert missing.value.body["type"] == "error"
    assert missing.value.body["error"]["type"] == "not_found_error"


def test_a_group_per_sdk_trains_one_step(gw, smollm2_server, celery_workers, tmp_path):
    """examples/tools/agent.py, one group of 2 rollouts per SDK, through the driver, the
    rollout workers and verl's engine: one update on every protocol's captures."""
    from app.config import load_config
    from app.driver.loop import train
    from examples.tools.agent import SDKS

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"a": 3 + i, "b": 4, "sdk": sdk}) + "\n"
                            for i, sdk in enumerate(SDKS)))
    cfg = load_config("config/arith.yaml", [
        *json.loads(os.environ["CARRYOVER_OVERRIDES"]), *SERVING,
        f"inference.urls=[{smollm2_server}]", f"gateway.url={gw}",
        "controller.agent=examples.tools.agent:run", f"data.train_files={data}",
        "data.val_files=null", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.total_steps=1", f"data.train_batch_size={len(SDKS)}",
        "actor_rollout_ref.rollout.n=2",
        # both cores for the update: the engine is idle by then (one spare group at most),
        # so the update's threads have nothing to spin against (measured here: 147 -> 108 s)
        "trainer.cpu_threads=2",
        f"agentlightning.async_rollout.async_train_batch_size={len(SDKS) + 1}",
        f"logging.dir={tmp_path / 'runs'}", "logging.wandb_mode=disabled",
        "logging.console=false", f"trainer.weights_dir={tmp_path / 'weights'}",
        f"trainer.checkpoint_dir={tmp_path / 'checkpoints'}"])
    steps: list[dict] = []
    result = train(cfg, on_step=lambda s, m: steps.append(m))
    assert result["steps"] == 1
    m = steps[0]
    assert m["batch/groups"] == len(SDKS) and m["batch/rollouts"] == 2 * len(SDKS)
    assert m["batch/excluded_samples"] == 0 and m["batch/trained_tokens"] > 0
    assert m["batch/samples"] >= 2 * len(SDKS)
    # each rollout's tool turn, and no other, was sampled under the tool's grammar
    assert m["batch/constrained_calls"] == 2 * len(SDKS)
    assert m["weight_sync/probe_gap"] < float(cfg.trainer.probe_tolerance)


def test_the_anthropic_and_responses_clients_ride_through_a_pause(gw, new_rollout,
                                                                  redis_client):
    """While the gateway is paused each protocol gets its own retryable error (Messages: 503
    overloaded_error with retry-after; Responses: OpenAI's 503), which the SDKs retry."""
    import threading
    import time

    import anthropic
    import httpx
    import httpx2
    import requests
    from openai import OpenAI

    from app.state.pause import Pause

    rid, token, base = new_rollout(gw)
    pause = Pause(redis_client)
    assert pause.pause() == 0
    try:
        raw = requests.post(base + "/messages", headers={"x-api-key": token}, timeout=10,
                            json={"model": NAME, "max_tokens": 4,
                                  "messages": [{"role": "user", "content": "hi"}]})
        assert raw.status_code == 503 and raw.headers["x-should-retry"] == "true"
        assert raw.json()["error"]["type"] == "overloaded_error"
        assert "Retry-After" in raw.headers
        results: dict = {}
        refused = {"anthropic": 0, "responses": 0}

        def counting(sdk: str, http: Any) -> Any:  # each SDK's own httpx package
            def count(response: Any) -> None:
                refused[sdk] += response.status_code == 503
            return http.Client(event_hooks={"response": [count]})

        def via_anthropic() -> None:
            client = anthropic.Anthropic(base_url=base.removesuffix("/v1"), api_key=token,
                                         max_retries=20, http_client=counting("anthropic", httpx2))
            results["anthropic"] = client.messages.create(
                model=NAME, max_tokens=4, messages=[{"role": "user", "content": "hi"}])

        def via_responses() -> None:
            client = OpenAI(base_url=base, api_key=token, max_retries=20,
                            http_client=counting("responses", httpx))
            results["responses"] = client.responses.create(model=NAME, input="hi",
                                                           max_output_tokens=4)

        threads = [threading.Thread(target=via_anthropic), threading.Thread(target=via_responses)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while not all(refused.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(refused.values()), refused  # each SDK was refused, and retries
        assert not results  # nothing gets through while paused
    finally:
        pause.resume()
    for t in threads:
        t.join(60)
    assert results["anthropic"].content is not None and results["responses"].output
    captured(redis_client, rid, 2)  # only the two admitted calls


def test_a_streamed_anthropic_message_is_carried_on_across_a_weight_load(
        gw, smollm2_server, new_rollout, redis_client, tmp_path):
    """gateway.drain_mode continue on the Messages API: the engine ends the call at the
    trainer's pause, the gateway carries it on after the load, and the SDK's stream reads
    one message to its max_tokens, its usage counting every token."""
    import threading
    import time

    import anthropic
    from transformers import AutoTokenizer

    from app.state.pause import Pause
    from workers.trainer import drain, publish

    rid, token, base = new_rollout(gw)
    # greedy (a rollout's own temperature, as an evaluation's): at temperature 1 the model
    # may end its count early, before the cut or soon after it
    redis_client.hset(keys.rollout(rid), "temperature", 0)
    client = anthropic.Anthropic(base_url=base.removesuffix("/v1"), api_key=token,
                                 max_retries=0)
    got: dict = {"text": ""}

    def agent() -> None:
        with client.messages.stream(
                model=NAME, max_tokens=120,
                messages=[{"role": "user", "content": "Count from 1 to 500, one number "
                                                      "per line."}]) as stream:
            for text in stream.text_stream:
                got["text"] += text
            got["final"] = stream.get_final_message()

    version = int(redis_client.get(keys.policy_version()) or 0)
    t = threading.Thread(target=agent)
    t.start()
    deadline = time.monotonic() + 120
    while len(got["text"]) < 6:
        assert time.monotonic() < deadline and t.is_alive(), got
        time.sleep(0.01)
    pause = Pause(redis_client)
    pause.pause(60)
    metrics: dict = {}
    held = drain.DRAINS["continue"](30.0, [smollm2_server]).quiet(pause, metrics)
    try:
        assert metrics["training/async/proxy_continued_calls"] == 1
        time.sleep(0.5)
        assert t.is_alive() and "final" not in got  # the agent still reads its message
        publish.switch_weights(redis_client, [smollm2_server], MODEL, version + 1, held, 60, 1)
    finally:
        pause.resume()
    t.join(120)
    final = got["final"]
    call = captured(redis_client, rid, 1)[0]
    # one message, its usage counting the tokens on both sides of the cut
    assert final.usage.output_tokens == len(call.response_ids)
    assert final.stop_reason == "max_tokens" and len(call.response_ids) == 120
    assert call.policy_version_end == version + 1
    assert call.version_switches and 0 < call.version_switches[0][0] < 120
    # the text the agent read is the tokens sampled, across the cut
    assert got["text"] == final.content[0].text
    assert AutoTokenizer.from_pretrained(str(MODEL)).decode(
        call.response_ids, skip_special_tokens=True) == got["text"]

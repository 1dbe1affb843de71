"""Token continuity on the real tokenizer and chat template (SmolLM2 with its tool-aware
template) and a real Redis: a later turn continues from the tokens that were sampled, and
falls back to rendering wherever the conversation is not the one kept."""

from __future__ import annotations

import pytest

from app.state.pause import Admission
from app.state.records import CapturedCall
from gateway.context import served_tokenizer
from gateway.continuity import Continuity
from tests.conftest import REPO, SMOLLM2

TEMPLATE = str(REPO / "config" / "templates" / "smollm2-tools.jinja")
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = {"id": "call-1", "type": "function",
        "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}


@pytest.fixture(scope="module")
def tok():
    assert (SMOLLM2 / "tokenizer.json").exists(), "scripts/setup.sh builds the model"
    return served_tokenizer(SMOLLM2, TEMPLATE)


def sampled_in_pieces(tok, text: str) -> list[int]:
    """The answer as a grammar makes the model write it: in other pieces than the
    tokenizer's (here, as vLLM's tool grammar did: each quote a token of its own), so
    re-rendering it gives other tokens."""
    ids: list[int] = []
    for piece in text.replace('"', '\0"\0').split("\0"):
        ids += tok.encode(piece, add_special_tokens=False)
    return ids + [tok.eos_token_id]


def record(tok, redis_client, rid: str, body: dict, answer: dict, prompt: list[int],
           response: list[int]) -> None:
    """The gateway's capture write, with the turn kept as the gateway keeps it."""
    call = CapturedCall(list(prompt), list(response), [-0.1] * len(response), "stop", 1, 1.0,
                        "u", 0.0, 0.0, "chat.completions")
    turn = Continuity(tok, redis_client).turn(body, answer, list(response))
    admission = Admission(redis_client)
    assert admission.record_and_release(admission.admit(rid)[1], [call.to_json()], turn)


def first_turn(tok, redis_client, rid: str, question: str = "What is 3 + 4?"):
    body = {"messages": [{"role": "user", "content": question}], "tools": TOOLS}
    prompt = tok.apply_chat_template(body["messages"], tools=TOOLS, add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    answer = '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
    response = sampled_in_pieces(tok, answer)
    record(tok, redis_client, rid, body, {"content": "", "tool_calls": [CALL]}, prompt,
           response)
    return body, list(prompt), response


def second_turn(body, assistant=None, tools=TOOLS):
    msgs = [*body["messages"], assistant or {"role": "assistant", "content": None,
                                             "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call-1", "content": "7"}]
    return {"messages": msgs, "tools": tools}


def test_a_later_turn_continues_from_the_sampled_tokens(tok, redis_client):
    body, prompt, response = first_turn(tok, redis_client, "r1")
    nxt = second_turn(body)
    rendered = tok.apply_chat_template(nxt["messages"], tools=TOOLS, add_generation_prompt=True,
                                       tokenize=True, return_dict=False)
    assert list(rendered[:len(prompt + response)]) != prompt + response  # re-rendering differs
    ids = Continuity(tok, redis_client).prompt_ids("r1", nxt)
    assert ids is not None and ids[:len(prompt + response)] == prompt + response
    # the same text as the template's, only the answer's tokens are the sampled ones
    assert tok.decode(ids) == tok.apply_chat_template(
        nxt["messages"], tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert tok.decode(ids[len(prompt + response):]).startswith("\n<|im_start|>user\n<tool_")


def test_new_messages_given_as_text_parts_are_rendered_as_the_server_renders_them(
        tok, redis_client):
    """The OpenAI Agents SDK and others send a content as a list of text parts; vLLM joins
    them with newlines for a template that takes a string (this one: it fails on a list),
    and the continued prompt must carry the same text."""
    body, prompt, response = first_turn(tok, redis_client, "r1p")
    nxt = second_turn(body)
    nxt["messages"][-1]["content"] = [{"type": "text", "text": "7"}]
    nxt["messages"].append({"role": "user", "content": [{"type": "text", "text": "and"},
                                                         {"type": "text", "text": "then?"}]})
    ids = Continuity(tok, redis_client).prompt_ids("r1p", nxt)
    assert ids is not None and ids[:len(prompt + response)] == prompt + response
    joined = [*nxt["messages"][:-2], {**nxt["messages"][-2], "content": "7"},
              {"role": "user", "content": "and\nthen?"}]
    assert tok.decode(ids) == tok.apply_chat_template(
        joined, tools=TOOLS, add_generation_prompt=True, tokenize=False)


def test_a_later_developer_message_merged_into_the_system_one_is_rendered(tok, redis_client):
    """This template names no developer role: vLLM makes a developer message a system one
    and merges every system message into the first, which changes the kept turn's
    prompt. The call is rendered, not continued without the message."""
    body, _, _ = first_turn(tok, redis_client, "r1d")
    nxt = second_turn(body)
    nxt["messages"].append({"role": "developer", "content": "answer in words"})
    assert Continuity(tok, redis_client).prompt_ids("r1d", nxt) is None


def test_the_echo_may_differ_in_ids_spacing_and_argument_formatting(tok, redis_client):
    body, prompt, response = first_turn(tok, redis_client, "r2")
    echoed = {"role": "assistant", "content": "", "tool_calls": [{
        "id": "toolu_other", "type": "function",
        "function": {"name": "add", "arguments": '{"a":3,"b":4}'}}]}
    ids = Continuity(tok, redis_client).prompt_ids("r2", second_turn(body, echoed))
    assert ids is not None and ids[:len(prompt + response)] == prompt + response


@pytest.mark.parametrize("change", ["arguments", "tools", "question"])
def test_anything_but_the_kept_conversation_is_rendered(tok, redis_client, change):
    body, _, _ = first_turn(tok, redis_client, "r3")
    nxt = second_turn(body)
    if change == "arguments":
        nxt["messages"][1] = {"role": "assistant", "content": "", "tool_calls": [{
            "function": {"name": "add", "arguments": '{"a": 3, "b": 5}'}}]}
    elif change == "tools":
        nxt["tools"] = [*TOOLS, {"type": "function", "function": {"name": "mul"}}]
    else:
        nxt["messages"][0] = {"role": "user", "content": "What is 3 + 5?"}
    assert Continuity(tok, redis_client).prompt_ids("r3", nxt) is None


def test_an_answer_cut_short_is_not_continued(tok, redis_client):
    body = {"messages": [{"role": "user", "content": "Say hello."}]}
    prompt = tok.apply_chat_template(body["messages"], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    cut = tok.encode("Hello there, how", add_special_tokens=False)  # no end-of-turn token
    assert Continuity(tok, redis_client).turn(body, {"content": "Hello there, how"}, cut) is None
    record(tok, redis_client, "r4", body, {"content": "Hello there, how"}, prompt, cut)
    nxt = {"messages": [*body["messages"], {"role": "assistant", "content": "Hello there, how"},
                        {"role": "user", "content": "Go on."}]}
    assert Continuity(tok, redis_client).prompt_ids("r4", nxt) is None


def test_parallel_chains_of_one_rollout_each_continue_their_own(tok, redis_client):
    a, prompt_a, resp_a = first_turn(tok, redis_client, "r5", "What is 3 + 4?")
    b, prompt_b, resp_b = first_turn(tok, redis_client, "r5", "Please add 3 and 4.")
    cont = Continuity(tok, redis_client)
    ids_a = cont.prompt_ids("r5", second_turn(a))
    ids_b = cont.prompt_ids("r5", second_turn(b))
    assert ids_a[:len(prompt_a + resp_a)] == prompt_a + resp_a
    assert ids_b[:len(prompt_b + resp_b)] == prompt_b + resp_b


def test_a_kept_turn_whose_call_was_lost_is_rendered(tok, redis_client):
    """A Redis crash that lost calls moves what sits at the kept position: the tag tells."""
    from app.state import keys

    body, _, _ = first_turn(tok, redis_client, "r6")
    other = CapturedCall([1, 2], [3, tok.eos_token_id], [-0.1, -0.1], "stop", 1, 1.0, "u", 0.0,
                         0.0, "chat.completions")
    redis_client.lset(keys.rollout_calls("r6"), 0, other.to_json())
    assert Continuity(tok, redis_client).prompt_ids("r6", second_turn(body)) is None


def test_a_continued_prompt_is_counted_as_its_ids(tok):
    """The context check counts the ids vLLM will get, not a rendering of the messages."""
    from gateway.context import ContextCheck

    check = ContextCheck(tok, 64)
    long = {"messages": [{"role": "user", "content": "word " * 200}], "max_tokens": 8}
    assert check.check(long, "chat.completions") is not None  # rendered: too long
    assert check.check(long, "chat.completions", list(range(50))) is None
    assert check.check(long, "chat.completions", list(range(60))) == (60, 8)


def test_a_reasoning_effort_is_rendered_and_counted_as_the_server_renders_it(tok, redis_client):
    """vLLM gives a chat's ``reasoning_effort`` to the template (gpt-oss's writes it into the
    system turn): a later turn is rendered, not continued without it, and the context
    check counts the prompt with it."""
    import copy

    from gateway.context import ContextCheck

    body, _, _ = first_turn(tok, redis_client, "r-effort")
    nxt = {**second_turn(body), "reasoning_effort": "high"}
    assert Continuity(tok, redis_client).prompt_ids("r-effort", nxt) is None
    # nor is a turn rendered with it kept for a later call without it
    assert Continuity(tok, redis_client).turn(
        {**body, "reasoning_effort": "high"}, {"content": "7"}, [5, tok.eos_token_id]) is None
    assert Continuity(tok, redis_client).turn(
        body, {"content": "7"}, [5, tok.eos_token_id]) is not None
    effort = copy.copy(tok)
    effort.chat_template = ("{% if reasoning_effort %}Reasoning: {{ reasoning_effort * 40 }}"
                            "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")
    check = ContextCheck(effort, 32)
    short = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    assert check.check(short, "chat.completions") is None
    over = check.check({**short, "reasoning_effort": "high"}, "chat.completions")
    assert over is not None and over[0] > 24, over

"""Weight loads that do not wait for generations (``gateway.drain_mode`` keep and abort),
against the real vLLM CPU server behind the gateway, with the trainer's own pause, switch
and resume functions.

- keep: long calls are frozen inside the engine, the new weights load, and the calls finish
  with all their tokens; each is captured with its start and end versions, a streamed one
  also with the index of its first token on the new weights. Teacher-forced, the tokens
  before that index score as the old weights do and the tokens after as the new ones do.
- abort: the call in flight gets a retryable error, nothing of it is captured, and the same
  call sent again after the load succeeds.
- continue: the engine ends the calls, the gateway keeps their tokens and carries them on
  after the load; the agents see whole answers, each captured as one call whose tokens
  switch version where the continuation began, scored as with keep.
"""

from __future__ import annotations

import statistics
import threading
import time

import pytest
import requests
import torch

from app.config.loader import REPO_ROOT
from app.state import keys
from app.state.pause import Pause
from app.state.records import CapturedCall
from bench.reference import PolicyTrainer
from workers.trainer import drain, publish, weights

pytestmark = pytest.mark.slow
MODEL = REPO_ROOT / "var" / "models" / "tiny-qwen2"
PROMPT = [1, 2, 3, 4]
LONG = 400


@pytest.fixture
def gw(redis_client, gateway_service, vllm_service):
    # the "old" weights are the base model's (an earlier test's run may have left others)
    weights.reload_weights(vllm_service, MODEL)
    redis_client.set(keys.policy_version(), 3)
    yield redis_client
    weights.resume_engines([vllm_service], check=False)
    Pause(redis_client).resume()
    weights.reload_weights(vllm_service, MODEL)  # leave the engine on the base model


def _body(cfg, stream: bool) -> dict:
    return {"model": cfg.inference.served_model_name, "prompt": PROMPT, "max_tokens": LONG,
            "ignore_eos": True, "temperature": 1.0, "stream": stream}


def _streamed(base: str, token: str, cfg, out: dict) -> None:
    import json

    out["ids"] = []
    resp = requests.post(f"{base}/completions", json={**_body(cfg, True), "logprobs": 0,
                                                      "return_token_ids": True},
                         headers={"Authorization": f"Bearer {token}"}, stream=True, timeout=120)
    out["status"] = resp.status_code
    for line in resp.iter_lines():
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                out["ids"].extend(choice.get("token_ids") or [])
                out["finish"] = choice.get("finish_reason") or out.get("finish")
                out.setdefault("finishes", []).append(choice.get("finish_reason"))
            if "error" in chunk:
                out["error"] = chunk["error"]


def _chat_streamed(base: str, token: str, cfg, out: dict) -> None:
    import json

    out["ids"], out["text"], out["finishes"] = [], "", []
    body = {"model": cfg.inference.served_model_name, "max_tokens": LONG, "ignore_eos": True,
            "temperature": 1.0, "stream": True, "return_token_ids": True,
            "messages": [{"role": "user", "content": "tell a long story"}]}
    resp = requests.post(f"{base}/chat/completions", json=body, stream=True, timeout=120,
                         headers={"Authorization": f"Bearer {token}"})
    out["status"] = resp.status_code
    for line in resp.iter_lines():
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            out["error"] = chunk.get("error") or out.get("error")
            for choice in chunk.get("choices") or []:
                out["ids"].extend(choice.get("token_ids") or [])
                out["text"] += (choice.get("delta") or {}).get("content") or ""
                out["finishes"].append(choice.get("finish_reason"))


def _plain(base: str, token: str, cfg, out: dict, extra: dict | None = None) -> None:
    resp = requests.post(f"{base}/completions", json={**_body(cfg, False), **(extra or {})},
                         headers={"Authorization": f"Bearer {token}"}, timeout=120)
    out["status"], out["body"] = resp.status_code, resp.json()


def _new_weights(cfg, tmp_path):
    """The base model moved far enough that the two score any text very differently."""
    trainer = PolicyTrainer(cfg, str(MODEL))
    old = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    torch.manual_seed(0)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    path = weights.save_weights(trainer.model, tmp_path, 4, keep=2)
    return trainer, old, {k: v.clone() for k, v in trainer.model.state_dict().items()}, path


def _scores(trainer, state: dict, ids: list[int], prompt: list[int] = PROMPT) -> list[float]:
    """Teacher-forced log-probs of the response tokens (temperature 1)."""
    trainer.model.load_state_dict(state)
    with torch.no_grad():
        logits = trainer.model(input_ids=torch.tensor([prompt + ids])).logits.float()
    logp = torch.log_softmax(logits[0, len(prompt) - 1:-1], dim=-1)
    return logp.gather(1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1).tolist()


def _gap(a: list[float], b: list[float]) -> float:
    return statistics.fmean(abs(x - y) for x, y in zip(a, b, strict=True))


def _wait(pred, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.002)


def _settled(stream: dict, quiet_s: float = 0.5, timeout: float = 15) -> int:
    """The streamed call's token count once none has arrived for ``quiet_s`` (chunks sent
    before the engine paused may still be on their way on a loaded machine); a stream that
    never goes quiet fails."""
    end = time.monotonic() + timeout
    count, since = len(stream["ids"]), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < end, "tokens kept arriving while the engine was paused"
        time.sleep(0.02)
        if len(stream["ids"]) != count:
            count, since = len(stream["ids"]), time.monotonic()
    return count


def _two_long_calls(client, new_rollout, cfg, under_way: int):
    """A streamed and a plain long call, each in its rollout, both admitted (two live
    leases) and the streamed one ``under_way`` tokens in. -> (rollout ids, streamed, plain,
    threads)."""
    streamed: dict = {}
    plain: dict = {"rollout": new_rollout()}
    rid_s, tok_s, base_s = new_rollout()
    rid_p, tok_p, base_p = plain["rollout"]
    threads = [threading.Thread(target=_streamed, args=(base_s, tok_s, cfg, streamed)),
               threading.Thread(target=_plain, args=(base_p, tok_p, cfg, plain))]
    for t in threads:
        t.start()
    _wait(lambda: len(streamed.get("ids", ())) >= under_way, 60,
          "the streamed call to be under way")
    # on a busy machine the plain call's thread may not have reached the gateway yet
    _wait(lambda: client.zcard(keys.leases()) >= 2, 60, "both calls to be admitted")
    return (rid_s, rid_p), streamed, plain, threads


def _hold(client, url: str, mode: str) -> tuple[Pause, dict, weights.Held]:
    """The trainer's first moves: pause the gateway, then the engines in ``mode``."""
    adm = Pause(client)
    adm.pause(30)
    metrics: dict = {}
    return adm, metrics, drain.DRAINS[mode](30.0, [url]).quiet(adm, metrics)


def test_keep_freezes_long_calls_across_a_real_weight_load(gw, new_rollout, cfg, tmp_path,
                                                           vllm_service):
    trainer, old, new, path = _new_weights(cfg, tmp_path)
    (rid_s, rid_p), streamed, plain, threads = _two_long_calls(gw, new_rollout, cfg, 40)
    adm, metrics, held = _hold(gw, vllm_service, "keep")
    at_switch = _settled(streamed)  # frozen: nothing more arrives
    assert 40 <= at_switch < LONG and metrics["training/async/proxy_frozen_calls"] == 2
    time.sleep(0.5)
    assert len(streamed["ids"]) == at_switch, "tokens arrived while the engine was paused"
    assert all(t.is_alive() for t in threads)  # nothing was cancelled or failed

    assert held.frozen_calls
    loaded = publish.switch_weights(gw, [vllm_service], path, 4, held, 30, 1)
    assert loaded == [vllm_service] and held.urls == []
    adm.resume()
    for t in threads:
        t.join(120)
    assert streamed["status"] == 200 and "error" not in streamed
    assert len(streamed["ids"]) == LONG and streamed["finish"] == "length"
    assert plain["status"] == 200 and plain["body"]["choices"][0]["finish_reason"] == "length"

    call_s = CapturedCall.from_json(gw.lrange(keys.rollout_calls(rid_s), 0, -1)[0])
    call_p = CapturedCall.from_json(gw.lrange(keys.rollout_calls(rid_p), 0, -1)[0])
    assert call_s.response_ids == streamed["ids"] and len(call_p.response_ids) == LONG
    assert (call_s.policy_version, call_s.policy_version_end) == (3, 4)
    assert call_s.version_switches == [[at_switch, 4]]
    assert call_s.tokens_after_switch() == LONG - at_switch
    # not streamed: it spans the load, where it switched is unknown
    assert (call_p.policy_version, call_p.policy_version_end, call_p.version_switches) == \
        (3, 4, None)

    # What the engine returned is what sampled each token: the old weights before the
    # switch, the new weights (reading a prefix recomputed by them) after it.
    ids, engine = call_s.response_ids, call_s.logprobs
    under_old, under_new = _scores(trainer, old, ids), _scores(trainer, new, ids)
    k = at_switch
    before_old, before_new = _gap(engine[:k], under_old[:k]), _gap(engine[:k], under_new[:k])
    after_old, after_new = _gap(engine[k:], under_old[k:]), _gap(engine[k:], under_new[k:])
    assert before_old < 1e-3 < 0.1 < before_new, (before_old, before_new)
    assert after_new < 1e-3 < 0.1 < after_old, (after_new, after_old)


def test_abort_gives_a_retryable_error_and_the_call_is_sent_again(gw, new_rollout, cfg,
                                                                  tmp_path, vllm_service):
    _, _, _, path = _new_weights(cfg, tmp_path)
    (rid, rid_p), streamed, plain, threads = _two_long_calls(gw, new_rollout, cfg, 20)
    adm, metrics, held = _hold(gw, vllm_service, "abort")
    for t in threads:
        t.join(30)
    assert metrics["training/async/proxy_aborted_calls"] == 2
    assert adm.live_leases() == 0
    # the agents were told to retry; nothing of the cut calls was recorded
    assert streamed["error"]["code"] == "cancelled_by_update" and len(streamed["ids"]) < LONG
    assert plain["status"] == 503 and plain["body"]["error"]["code"] == "cancelled_by_update"
    assert gw.llen(keys.rollout_calls(rid)) == 0 and gw.llen(keys.rollout_calls(rid_p)) == 0

    assert not held.frozen_calls
    publish.switch_weights(gw, [vllm_service], path, 4, held, 30, 1)
    adm.resume()
    again: dict = {}
    _, tok_p, base_p = plain["rollout"]
    _plain(base_p, tok_p, cfg, again)
    assert again["status"] == 200
    call = CapturedCall.from_json(gw.lrange(keys.rollout_calls(rid_p), 0, -1)[0])
    assert (call.policy_version, call.policy_version_end) == (4, None)
    assert len(call.response_ids) == LONG


def test_continue_carries_cut_calls_on_across_a_real_weight_load(
        gw, new_rollout, cfg, tmp_path, vllm_service):
    trainer, old, new, path = _new_weights(cfg, tmp_path)
    (rid_s, rid_p), streamed, plain, threads = _two_long_calls(gw, new_rollout, cfg, 40)
    chat: dict = {}
    rid_c, tok_c, base_c = new_rollout()
    threads.append(threading.Thread(target=_chat_streamed, args=(base_c, tok_c, cfg, chat)))
    threads[-1].start()
    _wait(lambda: len(chat.get("ids", ())) >= 10, 60, "the chat call to be under way")
    # two choices in one call cannot be carried on as one: that agent retries instead
    two: dict = {}
    rid_2, tok_2, base_2 = new_rollout()
    threads.append(threading.Thread(target=_plain, args=(base_2, tok_2, cfg, two, {"n": 2})))
    threads[-1].start()
    _wait(lambda: Pause(gw).live_leases() == 4, 30, "four calls in flight")
    time.sleep(0.5)
    adm, metrics, held = _hold(gw, vllm_service, "continue")
    assert metrics["training/async/proxy_continued_calls"] == 4
    threads[-1].join(30)
    assert two["status"] == 503 and two["body"]["error"]["code"] == "cancelled_by_update"
    assert gw.llen(keys.rollout_calls(rid_2)) == 0
    at_cut = _settled(streamed)  # the engine ended the calls; the gateway keeps them, waits
    assert 40 <= at_cut < LONG
    time.sleep(0.5)
    assert len(streamed["ids"]) == at_cut, "tokens arrived while the engine was paused"
    assert all(t.is_alive() for t in threads[:3])  # the agents still wait for their answers
    assert not held.frozen_calls  # nothing holds the KV cache: the engine could sleep

    publish.switch_weights(gw, [vllm_service], path, 4, held, 30, 1)
    adm.resume()
    for t in threads:
        t.join(120)
    # whole answers: the agents never saw the cut
    assert streamed["status"] == 200 and "error" not in streamed
    assert len(streamed["ids"]) == LONG and streamed["finish"] == "length"
    assert [f for f in streamed["finishes"] if f] == ["length"]
    assert plain["status"] == 200, plain["body"]
    choice = plain["body"]["choices"][0]
    assert choice["finish_reason"] == "length"
    assert plain["body"]["usage"]["completion_tokens"] == LONG

    call_s = CapturedCall.from_json(gw.lrange(keys.rollout_calls(rid_s), 0, -1)[0])
    call_p = CapturedCall.from_json(gw.lrange(keys.rollout_calls(rid_p), 0, -1)[0])
    assert gw.llen(keys.rollout_calls(rid_s)) == gw.llen(keys.rollout_calls(rid_p)) == 1
    assert call_s.response_ids == streamed["ids"] and len(call_p.response_ids) == LONG
    assert call_s.prompt_ids == call_p.prompt_ids == PROMPT
    assert (call_s.policy_version, call_s.policy_version_end) == (3, 4)
    assert call_s.version_switches == [[at_cut, 4]]
    # not streamed, yet the gateway knows where it switched: where it sent the call again
    assert (call_p.policy_version, call_p.policy_version_end) == (3, 4)
    assert call_p.version_switches and 0 < call_p.version_switches[0][0] < LONG
    # a streamed chat call: one answer, one call from the rendered prompt on
    assert chat["status"] == 200 and not chat["error"], chat.get("error")
    assert len(chat["ids"]) == LONG and [f for f in chat["finishes"] if f] == ["length"]
    call_c = CapturedCall.from_json(gw.lrange(keys.rollout_calls(rid_c), 0, -1)[0])
    assert call_c.response_ids == chat["ids"] and call_c.endpoint == "chat.completions"
    assert call_c.version_switches and 10 <= call_c.version_switches[0][0] < LONG

    # The tokens before the cut score as the old weights do, the ones after as the new
    # ones do (their prefix recomputed by one prefill on the new weights).
    for call in (call_s, call_p, call_c):
        ids, engine, k = call.response_ids, call.logprobs, call.version_switches[0][0]
        under_old = _scores(trainer, old, ids, call.prompt_ids)
        under_new = _scores(trainer, new, ids, call.prompt_ids)
        before_old, before_new = (_gap(engine[:k], under_old[:k]),
                                  _gap(engine[:k], under_new[:k]))
        after_old, after_new = _gap(engine[k:], under_old[k:]), _gap(engine[k:], under_new[k:])
        assert before_old < 1e-3 < 0.1 < before_new, (before_old, before_new)
        assert after_new < 1e-3 < 0.1 < after_old, (after_new, after_old)


def test_a_streamed_call_cut_before_its_first_token_is_carried_on(redis_client, new_rollout,
                                                                   cfg, tmp_root):
    """A call still waiting in the engine (here for its one slot) when an update aborts it
    has sampled nothing, and vLLM then sends no abort chunk: after its first (role) chunk
    the stream just ends. That was taken for a whole answer: the agent got an empty turn
    with no finish reason, and an empty call was recorded. It is carried on like any cut
    call."""
    import json

    from tests.conftest import gateway_process, model_server

    name = cfg.inference.served_model_name
    with model_server(MODEL, name, tmp_root / "logs", "inference.max_num_seqs=1") as url, \
            gateway_process(tmp_root, "gateway-one-slot", [url],
                            "inference.max_num_seqs=1") as (gateway, _):
        redis_client.set(keys.policy_version(), 3)
        first: dict = {}
        rid_1, tok_1, base_1 = new_rollout(gateway)
        rid_2, tok_2, base_2 = new_rollout(gateway)
        chat: dict = {}
        threads = [threading.Thread(target=_streamed, args=(base_1, tok_1, cfg, first)),
                   threading.Thread(target=_chat_streamed, args=(base_2, tok_2, cfg, chat))]
        threads[0].start()
        _wait(lambda: len(first.get("ids", ())) >= 10, 60, "the first call to be under way")
        threads[1].start()

        def waiting() -> bool:
            text = requests.get(url + "/metrics", timeout=5).text
            return any(line.startswith("vllm:num_requests_waiting") and
                       float(line.rsplit(" ", 1)[1]) >= 1 for line in text.splitlines())

        _wait(waiting, 60, "the chat call to wait for the slot")
        adm, _, held = _hold(redis_client, url, "continue")  # aborts both
        time.sleep(1.0)
        assert threads[1].is_alive() and not chat["ids"]  # its agent still waits
        held.release()
        adm.resume()
        # a second update while one of the two continuations waits for the slot: that one
        # is cut before its first token too (the answer so far holds the first cut's abort)
        _wait(waiting, 60, "a continuation to wait for the slot")
        adm, _, held = _hold(redis_client, url, "continue")
        time.sleep(0.5)
        held.release()
        adm.resume()
        for t in threads:
            t.join(120)
        for out in (first, chat):
            assert out["status"] == 200 and not out.get("error"), out.get("error")
            assert len(out["ids"]) == LONG
            assert [f for f in out["finishes"] if f] == ["length"]
        (raw,) = redis_client.lrange(keys.rollout_calls(rid_2), 0, -1)
        assert CapturedCall.from_json(raw).response_ids == chat["ids"]
        assert json.loads(raw)["endpoint"] == "chat.completions"

"""Evaluation during training through the real stack (Redis, Celery, gateway, vLLM, trainer):
held-out prompts are evaluated before training, every ``test_freq`` steps and after the last,
greedily unless ``val_kwargs.do_sample``, never trained, each report naming the policy
versions that served it."""

from __future__ import annotations

import json
import os

import pytest

from app.config import load_config
from app.driver.loop import train
from app.state import keys
from app.state.records import CapturedCall
from tests.conftest import wait_rollouts_idle

pytestmark = pytest.mark.slow


def _cfg(tmp_path, *overrides: str):
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"text": t, "target": t[::-1]}) + "\n"
                           for t in ("abc", "dab", "cca")))
    return load_config("config/demo.yaml", [
        *json.loads(os.environ["CARRYOVER_OVERRIDES"]),
        f"data.val_files={val}", "trainer.test_freq=2", "trainer.total_steps=3",
        "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
        "agentlightning.async_rollout.async_train_batch_size=3",
        "agent.tool_median_s=0", f"logging.dir={tmp_path / 'runs'}",
        "logging.wandb_mode=disabled", "logging.console=false",
        f"trainer.weights_dir={tmp_path / 'weights'}",
        f"trainer.checkpoint_dir={tmp_path / 'checkpoints'}", *overrides])


def test_an_evaluation_that_makes_progress_is_not_cut_by_its_timeout(redis_client, tmp_path,
                                                                      monkeypatch):
    """A large held-out set runs in rounds of the free rollout slots and waits out weight
    loads: its timeout counts from the last group that finished, not from its start."""
    import types

    from app.driver import evaluation
    from app.driver.collector import Collector
    from app.driver.evaluation import Evaluator, PendingEval

    now = [1000.0]  # the clock the evaluator reads
    monkeypatch.setattr(evaluation, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(Evaluator, "feed", lambda self, all_at_once=False: 0)  # no workers
    cfg = _cfg(tmp_path)
    run = f"eval-progress-{tmp_path.name[-8:]}"
    evaluator = Evaluator(redis_client, run, cfg)
    evaluator.timeout_s = 10.0
    eval_id = f"{run}-val2"
    Collector.create_run(redis_client, eval_id, cfg.to_dict(), "eval")
    evaluator.pending = PendingEval(eval_id, 2, 2, now[0], 4,
                                    Collector(redis_client, eval_id, cfg), progress_at=now[0])
    for i in range(3):  # a group finishes every 6 s: 18 s in all, past the timeout
        now[0] += 6.0
        redis_client.zadd(keys.run_ready(eval_id), {f"{eval_id}-g{i}": i})
        assert evaluator.poll() is None and evaluator.pending is not None, i
    now[0] += 12.0  # then nothing for longer than the timeout
    assert evaluator.poll() is None and evaluator.pending is None


def test_evaluations_run_beside_training_and_are_never_trained(
        redis_client, gateway_service, celery_workers, tmp_path):
    evals: list[tuple[int, dict]] = []
    steps: list[dict] = []
    # the periodic one keeps one group in flight, the next prompt sent as it finishes
    result = train(_cfg(tmp_path, "trainer.val_active_groups=1"),
                   on_step=lambda s, m: steps.append(m),
                   on_eval=lambda s, m: evals.append((s, m)))
    assert result["steps"] == 3
    sent = [m["val/sent_at_step"] for _, m in evals]
    # before training, after 2 updates (test_freq), after the last one
    assert sent == [0.0, 2.0, 3.0], evals
    first = evals[0][1]
    assert first["val/policy_version_min"] == first["val/policy_version_max"]
    for _, m in evals:
        assert m["val/n_prompts"] == 3 and m["val/n_rollouts"] == 3  # val_kwargs.n = 1
        # a success is a rollout with reward 1, and rewards are in [0, 1]
        assert m["val/reward_mean"] >= m["val/success_rate"]
        assert m["val/policy_version_min"] <= m["val/policy_version_max"]
    # the final evaluation ran on the final weights
    assert evals[-1][1]["val/policy_version_min"] == int(redis_client.get(keys.policy_version()))
    # every step trained exactly its training groups, none of the evaluation's
    assert all(m["batch/groups"] == 2 and m["batch/rollouts"] == 4 for m in steps)
    # evaluation runs are finished, their captured calls released, the rest expiring
    eval_ids = sorted(_eval_runs(redis_client, result["run_id"]))
    assert [e.split("-val")[1].split("-")[0] for e in eval_ids] == ["0", "2", "3"]
    for eval_id in eval_ids:
        assert redis_client.hget(keys.run(eval_id), "mode") == "eval"
        assert redis_client.hget(keys.run(eval_id), "status") == "finished"
        assert redis_client.ttl(keys.run(eval_id)) > 0
        assert redis_client.zcard(keys.run_ready(eval_id)) == 3
        for gid in redis_client.zrange(keys.run_ready(eval_id), 0, -1):
            assert not redis_client.exists(keys.group_rollouts(gid))


def test_an_evaluation_rollout_is_sampled_at_its_own_temperature(redis_client, gateway_service,
                                                                 cfg):
    import openai

    from workers.rollout.episode import _start_attempt

    for own, expected in ((0.0, 0.0), (None, float(cfg.actor_rollout_ref.rollout.temperature))):
        rid, token = _start_attempt(redis_client, "eval-temp", "eval-temp-g0", 0, 1, own)
        client = openai.OpenAI(base_url=f"{gateway_service}/rollout/{rid}/v1", api_key=token)
        client.chat.completions.create(model=cfg.inference.served_model_name,
                                       messages=[{"role": "user", "content": "reverse abc"}])
        call = CapturedCall.from_json(redis_client.lindex(keys.rollout_calls(rid), 0))
        assert call.temperature == expected


def test_only_the_runs_own_evaluations_are_taken_up(redis_client, tmp_path):
    """A run named like one of its evaluations' prefix (``<run>-valid``) is another run's."""
    from app.driver.collector import Collector
    from app.driver.evaluation import Evaluator, eval_config

    cfg = _cfg(tmp_path)
    run = f"adopt-{tmp_path.name[-8:]}"
    plain = eval_config(cfg, 3)
    for other in (f"{run}-valid", f"{run}-val[2]-ab12"):
        Collector.create_run(redis_client, other, plain, "eval")
    assert Evaluator(redis_client, run, cfg).adopt(0) is None
    Collector.create_run(redis_client, f"{run}-val3-ab12", plain, "eval")
    pending = Evaluator(redis_client, run, cfg).adopt(0)
    assert pending is not None and (pending.eval_id, pending.step) == (f"{run}-val3-ab12", 3)


def _gated_cfg(tmp_path, *overrides: str):
    """Scripted agents; the held-out ones wait on the gate ``evaluation``."""
    from app.state.connection import resolve_redis_url

    env = json.loads(os.environ["CARRYOVER_OVERRIDES"])
    train_file, val_file = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train_file.write_text("".join(json.dumps({"text": f"t{i}"}) + "\n" for i in range(4)))
    val_file.write_text("".join(json.dumps({"text": f"v{i}", "gate": "evaluation"}) + "\n"
                                for i in range(2)))
    return load_config(None, [
        *env, f"data.train_files={train_file}", f"data.val_files={val_file}",
        "trainer.test_freq=1", "trainer.val_before_train=false",
        "controller.agent=tests.agents:scripted",
        f"agent.redis_url={resolve_redis_url(load_config(None, env))}",
        "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
        "agentlightning.async_rollout.async_train_batch_size=3",
        f"logging.dir={tmp_path / 'runs'}", "logging.wandb_mode=disabled",
        "logging.console=false", f"trainer.weights_dir={tmp_path / 'weights'}",
        f"trainer.checkpoint_dir={tmp_path / 'checkpoints'}", *overrides])


def _eval_runs(redis_client, run_id: str) -> list[str]:
    return [k.removeprefix(keys.run("")) for k in
            redis_client.scan_iter(keys.run(f"{run_id}-val*"))
            if ":" not in k.removeprefix(keys.run(""))]


@pytest.mark.parametrize("final", [False, True], ids=["periodic", "final"])
def test_an_evaluation_running_when_the_driver_died_is_taken_up_on_resume(
        redis_client, gateway_service, celery_workers, tmp_path, monkeypatch, final):
    """Its rollouts went on without a driver: the resumed one reports it (it was neither
    reported nor cancelled, and its records never expired), once (a final one taken up is
    not sent again)."""
    from app.driver.evaluation import Evaluator

    class Killed(BaseException):
        pass

    started, cancel = Evaluator.start, Evaluator.cancel
    killed_at = 2 if final else 1

    def start_then_die(self, steps_done, version):
        pending = started(self, steps_done, version)
        if steps_done == killed_at:
            raise Killed
        return pending

    cfg = _gated_cfg(tmp_path, "trainer.total_steps=2")
    run_id = f"eval-adopted-{tmp_path.name[-8:]}"
    monkeypatch.setattr(Evaluator, "start", start_then_die)
    monkeypatch.setattr(Evaluator, "cancel", lambda self: None)  # killed: no finally runs
    try:
        if final:  # the periodic evaluation ends before the final one starts
            redis_client.set("test:gate:evaluation", 1)
        with pytest.raises(Killed):
            train(cfg, run_id=run_id)
        monkeypatch.setattr(Evaluator, "start", started)
        monkeypatch.setattr(Evaluator, "cancel", cancel)
        left = [e for e in _eval_runs(redis_client, run_id)
                if redis_client.hget(keys.run(e), "status") == "running"]
        assert len(left) == 1 and f"-val{killed_at}-" in left[0], left
        redis_client.set("test:gate:evaluation", 1)
        evals: list[dict] = []
        result = train(cfg, resume=run_id, on_eval=lambda s, m: evals.append(m))
        assert result["steps"] == 2
        assert [m["val/sent_at_step"] for m in evals] == ([2.0] if final else [1.0, 2.0])
        assert all(m["val/n_rollouts"] == 2 for m in evals)
        runs = _eval_runs(redis_client, run_id)
        assert len(runs) == 2 and left[0] in runs
        assert all(redis_client.hget(keys.run(e), "status") == "finished" for e in runs)
    finally:
        redis_client.set("test:gate:evaluation", 1)
        wait_rollouts_idle(redis_client)
        redis_client.delete("test:gate:evaluation")


def test_a_run_that_stops_early_cancels_its_running_evaluation(
        redis_client, gateway_service, celery_workers, tmp_path):
    # held-out agents wait on a gate the test opens only after the run stopped
    cfg = _gated_cfg(tmp_path, "trainer.total_steps=3")
    evals: list[dict] = []
    try:
        result = train(cfg, should_stop=lambda step, m: step == 1,
                       on_eval=lambda s, m: evals.append(m))
    finally:
        redis_client.set("test:gate:evaluation", 1)
    assert result["steps"] == 2 and evals == []
    # sent after the first update; the one due after the second was skipped (still running)
    eval_ids = _eval_runs(redis_client, result["run_id"])
    assert len(eval_ids) == 1 and "-val1-" in eval_ids[0]
    eval_id = eval_ids[0]
    assert redis_client.hget(keys.run(eval_id), "status") == "finished"
    assert redis_client.zcard(keys.run_active(eval_id)) == 0
    for seq in range(2):
        assert redis_client.hget(keys.group(f"{eval_id}-g{seq}"), "status") == "cancelled"
    wait_rollouts_idle(redis_client)  # the gated agents saw the gate open before it goes
    redis_client.delete("test:gate:evaluation")


def test_a_driver_lost_after_the_final_report_does_not_evaluate_again(
        redis_client, gateway_service, celery_workers, tmp_path):
    """The driver dies after reporting the final evaluation and before the run is marked
    finished: the resumed run finishes without running or reporting that evaluation again."""
    class Lost(Exception):
        pass

    def die_after_final(steps_done: int, metrics: dict) -> None:
        if steps_done == 1:
            raise Lost

    cfg = _cfg(tmp_path, "trainer.total_steps=1", "trainer.test_freq=1",
               "trainer.val_before_train=false")
    run_id = f"eval-once-{tmp_path.name[-8:]}"
    with pytest.raises(Lost):
        train(cfg, run_id=run_id, on_eval=die_after_final)
    assert redis_client.hget(keys.run(run_id), "status") == "running"
    evals: list[int] = []
    result = train(cfg, resume=run_id, on_eval=lambda s, m: evals.append(s))
    assert result["steps"] == 1 and evals == []
    assert redis_client.hget(keys.run(run_id), "status") == "finished"
    reports = [json.loads(e) for e in redis_client.lrange(keys.run_metrics(run_id), 0, -1)]
    assert [e["step"] for e in reports if "val/reward_mean" in e] == [1], reports
    sent = _eval_runs(redis_client, run_id)
    assert len(sent) == 1 and "-val1-" in sent[0], sent  # one final evaluation was sent


def test_an_evaluation_a_driver_died_sending_is_sent_whole_on_resume(redis_client, tmp_path,
                                                                     monkeypatch):
    """The dead driver sent 1 of the 3 held-out prompts: the resumed one sent none of the
    rest and reported the 1 as the whole evaluation."""
    from app.config.schema import Config
    from app.driver.collector import Collector
    from app.driver.evaluation import EVAL_MODE, Evaluator, eval_config

    sent: list[str] = []

    def send(self, gid: str) -> None:  # no workers here: what is sent is what is checked
        sent.append(gid)
        self.r.hset(keys.group(gid), "sent", "1")

    monkeypatch.setattr(Collector, "_send", send)
    cfg = _cfg(tmp_path)
    run = f"eval-part-sent-{tmp_path.name[-8:]}"
    eval_id = f"{run}-val1-abcd"
    plain = eval_config(cfg, 3)
    Collector.create_run(redis_client, eval_id, plain, EVAL_MODE, 0.0)
    dead = Collector(redis_client, eval_id, Config.of(plain), n=1)
    dead.active_target = 1  # died after the first prompt's group
    assert dead.top_up(5, dispatch_step=1) == 1
    pending = Evaluator(redis_client, run, cfg).adopt(5)
    assert pending is not None and pending.n_groups == 3
    indexes = [redis_client.hget(keys.group(g), "sample_index") for g in sent]
    assert sorted(indexes) == ["0", "1", "2"]
    assert {redis_client.hget(keys.group(g), "dispatch_step") for g in sent} == {"1"}
    # one sent whole and then dropped a group: nothing more is sent at resume
    first = list(sent)
    sent.clear()
    redis_client.zrem(keys.run_active(eval_id), f"{eval_id}-g0")
    redis_client.rpush(keys.run_requeue(eval_id), "0")
    pending = Evaluator(redis_client, run, cfg).adopt(5)
    assert pending is not None and pending.n_groups == 3 and sent == []
    for gid in first:
        redis_client.delete(keys.group(gid))


def test_a_periodic_evaluation_keeps_its_cap_in_flight_and_sends_each_prompt_once(
        redis_client, tmp_path, monkeypatch):
    """A held-out set larger than ``trainer.val_active_groups`` is not queued whole beside
    training: its next prompt is sent as a group finishes, each prompt once; what is left
    is sent at once when it is waited for (nothing trains then)."""
    from app.driver.collector import Collector
    from app.driver.evaluation import Evaluator
    from app.state import carry
    from app.state.completion import finish_group
    from app.state.records import SiblingResult

    sent: list[str] = []

    def send(self, gid: str) -> None:  # no workers here: what is sent is what is checked
        sent.append(gid)
        self.r.hset(keys.group(gid), "sent", "1")

    monkeypatch.setattr(Collector, "_send", send)
    val = tmp_path / "big-val.jsonl"
    val.write_text("".join(json.dumps({"text": f"p{i}"}) + "\n" for i in range(7)))
    cfg = _cfg(tmp_path, f"data.val_files={val}", "trainer.val_active_groups=2")
    run = f"eval-fed-{tmp_path.name[-8:]}"
    evaluator = Evaluator(redis_client, run, cfg)
    # the held-out file is read once, when the driver starts
    monkeypatch.setattr("app.driver.collector.load_samples",
                        lambda *a, **k: pytest.fail("the held-out file was read again"))
    pending = evaluator.start(2, 4)
    assert pending.n_groups == 7 and len(sent) == 2
    assert evaluator.feed() == 0  # its cap is in flight

    def finish(gid: str) -> None:  # its siblings' results stored, then the chord callback
        for i in range(int(redis_client.hget(keys.group(gid), "n"))):
            result = SiblingResult(index=i, rollout_id="", status="ok", reward=1.0,
                                   attempts=1, seconds=0.1)
            assert carry.store_sibling_result(redis_client, pending.eval_id, gid, i,
                                              result.to_json())
        assert finish_group(redis_client, gid) == "complete"

    finish(sent[0])
    assert evaluator.poll() is None and len(sent) == 3  # the freed place, at the next look
    finish(sent[1])
    finish(sent[2])
    assert evaluator.feed() == 2 and len(sent) == 5
    assert not evaluator.finished(pending)
    assert evaluator.feed(all_at_once=True) == 2 and len(sent) == 7  # waited for: the rest
    assert evaluator.feed(all_at_once=True) == 0
    indexes = [redis_client.hget(keys.group(g), "sample_index") for g in sent]
    assert sorted(indexes) == [str(i) for i in range(7)]  # each prompt once, none twice
    for gid in sent[3:]:
        finish(gid)
    assert evaluator.finished(pending)
    assert evaluator.poll()["val/n_prompts"] == 7 and evaluator.pending is None
    for gid in sent:
        redis_client.delete(keys.group(gid))

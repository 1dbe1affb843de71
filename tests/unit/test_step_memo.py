"""The trainer worker's memory of the steps it trained: a re-sent step whose stored result a
Redis crash lost is answered from it, but only while the trainer that holds that update is
still the one loaded (record 2 of ``workers.trainer.once``)."""

from __future__ import annotations

from types import SimpleNamespace

from app.state import keys
from workers.trainer import once, resident, tasks
from workers.trainer import step as trainer_step


def test_a_remembered_step_is_answered_only_by_the_trainer_that_holds_it(redis_client,
                                                                         monkeypatch):
    trained: list[int] = []

    def run_step(client, run_id, step):
        trained.append(step)
        client.set(keys.run_step_result(run_id, step), "{}")
        return {"n": len(trained)}

    monkeypatch.setattr(trainer_step, "train_step", run_step)
    monkeypatch.setattr(once, "_trained", {})
    monkeypatch.setattr(resident, "_resident", SimpleNamespace(run_id="memo", generation=1))
    assert tasks.train_step("memo", 0) == {"n": 1}
    redis_client.delete(keys.run_step_result("memo", 0))  # lost in a Redis crash
    assert tasks.train_step("memo", 0) == {"n": 1} and trained == [0]  # answered
    assert redis_client.get(keys.run_step_result("memo", 0)) is not None  # stored again
    # the trainer was replaced (reloaded from a checkpoint that lacks step 0's update)
    monkeypatch.setattr(resident, "_resident", SimpleNamespace(run_id="memo", generation=2))
    redis_client.delete(keys.run_step_result("memo", 0))
    assert tasks.train_step("memo", 0) == {"n": 2} and trained == [0, 0]  # trained again


def test_an_update_already_in_the_weights_stays_due_until_its_publish_starts():
    """A step whose update ran here is published again, not trained again, on every
    attempt until a publish starts: a pause lost before it (the weights untouched) must not
    use the mark up, or the next attempt rolls the trainer back to its last checkpoint."""
    resident = SimpleNamespace(unrecorded=True, updated_step=4)
    assert once.update_already_in_weights(resident, 4)
    assert once.update_already_in_weights(resident, 4)  # the pause was lost: still due
    once.publishing_again(resident)
    assert not once.update_already_in_weights(resident, 4)  # one publish try only
    assert not once.update_already_in_weights(SimpleNamespace(unrecorded=False,
                                                              updated_step=4), 4)

"""What a run must share with the running gateway: values that mean the same compare equal
(1 and 1.0, URLs in another order or with a trailing slash, a LoRA rank at or below the
servers'),
values that do not are named, and the default max_tokens is only noted."""

from __future__ import annotations

from app.config import load_config
from app.config.serving import disagreements, gateway_view

URLS = "inference.urls=[http://127.0.0.1:8100,http://127.0.0.1:8101]"


def _differ(gateway: list[str], run: list[str]) -> tuple[list[str], list[str]]:
    return disagreements(gateway_view(load_config(None, run)),
                         gateway_view(load_config(None, gateway)))


def test_the_same_meaning_agrees():
    assert _differ([URLS, "actor_rollout_ref.rollout.temperature=1",
                    "actor_rollout_ref.model.lora_rank=16"],
                   ["inference.urls=[http://127.0.0.1:8101/,http://127.0.0.1:8100]",
                    "actor_rollout_ref.rollout.temperature=1.0",
                    "actor_rollout_ref.model.lora_rank=8"]
                   ) == ([], [])


def test_what_differs_is_named():
    refused, noted = _differ(
        [URLS], ["inference.urls=[http://127.0.0.1:8100]", "gateway.sampling=reject",
                 "actor_rollout_ref.model.lora_rank=8",
                 "actor_rollout_ref.rollout.max_tokens=64"])
    assert [line.split(":")[0] for line in refused] == [
        "inference.urls", "gateway.sampling", "actor_rollout_ref.model.lora_rank"]
    assert refused[1] == ("gateway.sampling: the running gateway serves with 'enforce', this "
                          "run's config says 'reject'")
    assert noted == ["actor_rollout_ref.rollout.max_tokens: the running gateway serves with "
                     "16, this run's config says 64"]

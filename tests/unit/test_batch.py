"""Batch rows: the turns of one rollout share a row, and the log-probs the update sees are
the ones the separate calls would have had."""

from __future__ import annotations

import torch
from transformers import AutoTokenizer

from app.config import load_config
from app.config.loader import REPO_ROOT
from bench.reference import PolicyTrainer, token_log_probs
from workers.trainer.batch import Sample, pack_turns, to_batch

MODEL = str(REPO_ROOT / "var" / "models" / "tiny-qwen2")


def _prompt(tok, messages: list[dict]) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def _two_turns(tok, word: str, answer: str, rollout_id: str, reward: float) -> list[Sample]:
    end = tok.convert_tokens_to_ids("<|im_end|>")
    first = [{"role": "user", "content": f"reverse {word}"}]
    r1 = tok.encode(answer, add_special_tokens=False) + [end]
    p2 = _prompt(tok, first + [{"role": "assistant", "content": answer},
                               {"role": "user", "content": f"again reverse {word}"}])
    r2 = tok.encode(answer[::-1], add_special_tokens=False) + [end]
    return [Sample(_prompt(tok, first), r1, [-1.0] * len(r1), reward, "g0", 1.0, 0, rollout_id),
            Sample(p2, r2, [-2.0] * len(r2), reward, "g0", 1.0, 1, rollout_id)]


def test_turns_of_one_rollout_share_a_row_with_the_same_log_probs():
    tok = AutoTokenizer.from_pretrained(MODEL)
    samples = (_two_turns(tok, "abcdef", "fedcba", "r1", 1.0)
               + _two_turns(tok, "xyz", "zy", "r2", 0.0))
    rows = pack_turns(samples)
    assert [r.calls for r in rows] == [2, 2]
    assert rows[0].tokens == samples[1].prompt_ids + samples[1].response_ids
    assert rows[0].logprobs == samples[0].rollout_logprobs + samples[1].rollout_logprobs

    trainer = PolicyTrainer(load_config(), MODEL)
    trainer.model.eval()
    packed = to_batch(samples, trainer.pad_id)
    assert len(packed) == 2 and packed.calls == [2, 2]
    assert packed.rewards.tolist() == [1.0, 0.0]
    with torch.no_grad():
        together, _ = token_log_probs(trainer.model, packed)
        for i, row in enumerate(rows):
            apart = [token_log_probs(trainer.model, to_batch([s], trainer.pad_id))[0][0]
                     [: len(s.response_ids)] for s in samples[2 * i: 2 * i + 2]]
            n = len(row.response_ids)
            assert torch.allclose(together[i, :n], torch.cat(apart), atol=1e-5)
            assert packed.response_mask[i].sum() == n
    assert torch.equal(packed.rollout_log_probs[0, :len(rows[0].logprobs)],
                       torch.tensor(rows[0].logprobs))


def test_calls_that_do_not_continue_the_conversation_keep_their_own_rows():
    tok = AutoTokenizer.from_pretrained(MODEL)
    a = _two_turns(tok, "abcdef", "fedcba", "r1", 1.0)
    # the agent rewrote its history: the second prompt no longer starts with the first call
    rewritten = Sample(_prompt(tok, [{"role": "user", "content": "again reverse abcdef"}]),
                       a[1].response_ids, a[1].rollout_logprobs, 1.0, "g0", 1.0, 1, "r1")
    assert [r.calls for r in pack_turns([a[0], rewritten])] == [1, 1]
    # another rollout, another temperature, or no rollout id: never merged
    other = Sample(**{**a[1].__dict__, "rollout_id": "r9"})
    hotter = Sample(**{**a[1].__dict__, "temperature": 0.7})
    anonymous = [Sample(**{**s.__dict__, "rollout_id": ""}) for s in a]
    for second in (other, hotter):
        assert [r.calls for r in pack_turns([a[0], second])] == [1, 1]
    assert [r.calls for r in pack_turns(anonymous)] == [1, 1]
    assert len(to_batch(anonymous, 0)) == 2

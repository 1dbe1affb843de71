"""Every field a Redis hash holds is declared in ``app.state.records``, including those the
Lua scripts write one at a time."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest

from app.state import carry, completion, pause
from app.state.records import GroupRecord, RolloutRecord, RunRecord

HASH_RECORDS = (RolloutRecord, GroupRecord, RunRecord)
# redis.call('HSET'|'HINCRBY'|'HGET'|'HMGET', KEYS[i], 'field', ...): the literal field names
CALL = re.compile(r"redis\.call\('(HSET|HINCRBY|HGET|HMGET)',\s*KEYS\[\d+\],\s*([^)]*)\)")


def _literal_fields(script: str) -> set[str]:
    names = set()
    for op, args in CALL.findall(script):
        tokens = [t.strip() for t in args.split(",")]
        # HSET's arguments alternate field, value; HINCRBY's are field, increment
        named = tokens[::2] if op == "HSET" else tokens[:1] if op == "HINCRBY" else tokens
        names.update(t.strip("'") for t in named if t.startswith("'"))
    return names


def _scripts() -> list[str]:
    return [v for mod in (carry, completion, pause) for v in vars(mod).values()
            if isinstance(v, str) and "redis.call(" in v]


def test_every_field_the_scripts_name_is_declared():
    declared = {f.name for rec in HASH_RECORDS for f in fields(rec)}
    named = set().union(*(_literal_fields(s) for s in _scripts()))
    assert named  # the pattern still finds the scripts' fields
    assert named - declared == set()


def test_field_refuses_an_undeclared_name():
    assert GroupRecord.field("task_ids") == "task_ids"
    with pytest.raises(KeyError, match="RunRecord has no field 'n_dispatch'"):
        RunRecord.field("n_dispatch")


def test_the_written_fields_round_trip():
    run = RunRecord("r", n_dispatched=3, n_dropped=1, finished_active=5, carry_unfinished=2)
    assert RunRecord.from_hash(run.to_hash()) == run
    group = GroupRecord("g", "r", 0, sent=1, task_ids=["a", "b"], callback_id="c",
                        selected_at=1.5)
    assert GroupRecord.from_hash(group.to_hash()) == group

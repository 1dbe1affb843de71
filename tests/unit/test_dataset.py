"""Prompts from JSONL or Parquet; bad files give one clear line naming the key."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.driver.dataset import DatasetError, epoch_order, load_samples


def test_jsonl_and_parquet_give_the_same_samples(tmp_path):
    rows = [{"text": "abc", "target": "cba"}, {"text": "bad", "target": "dab"}]
    (tmp_path / "d.jsonl").write_text('{"text": "abc", "target": "cba"}\n\n'
                                      '{"text": "bad", "target": "dab"}\n')
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert load_samples(str(tmp_path / "d.jsonl")) == rows
    assert load_samples(str(tmp_path / "d.parquet")) == rows


@pytest.mark.parametrize("content,fragment", [
    ("{not json\n", "not JSON"), ("[1, 2]\n", "must be a JSON object"), ("\n", "no samples")])
def test_bad_jsonl(tmp_path, content, fragment):
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(DatasetError, match=fragment) as info:
        load_samples(str(tmp_path / "d.jsonl"))
    assert str(info.value).startswith("data.train_files:")


def test_missing_file_and_epoch_order():
    with pytest.raises(DatasetError, match="cannot read"):
        load_samples("/no/such/file.jsonl")
    a, b = epoch_order(10, 0, 0, True), epoch_order(10, 0, 1, True)
    assert sorted(a) == list(range(10)) and a != b and a == epoch_order(10, 0, 0, True)
    assert epoch_order(5, 0, 3, False) == [0, 1, 2, 3, 4]


def test_undecodable_text_and_a_missing_parquet_file_name_the_key_and_line(tmp_path):
    (tmp_path / "d.jsonl").write_bytes(b'{"text": "abc"}\n{"text": "\xff"}\n')
    with pytest.raises(DatasetError) as info:
        load_samples(str(tmp_path / "d.jsonl"), key="data.val_files")
    assert str(info.value) == f"data.val_files: {tmp_path / 'd.jsonl'}:2: not UTF-8 text (byte 26)"
    with pytest.raises(DatasetError, match=r"cannot read /no/such/file.parquet \(no such file\)"):
        load_samples("/no/such/file.parquet")


def test_a_parquet_column_json_cannot_carry_is_named(tmp_path):
    """A timestamp column (pyarrow gives datetime values) failed once the run was recorded,
    as a TypeError naming no file."""
    import datetime

    rows = [{"text": "a", "at": datetime.datetime(2026, 1, 1)}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    with pytest.raises(DatasetError, match=r"data.val_files: .*t.parquet: row 1, column 'at': "
                                           r"a datetime value"):
        load_samples(str(tmp_path / "t.parquet"), key="data.val_files")

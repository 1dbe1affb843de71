"""How make test's xdist workers share the suite (tests/schedule.py)."""

from __future__ import annotations

import pytest

from tests.conftest import REPO
from tests.schedule import APART, SECONDS, distribute


class Item:
    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid
        self.groups: list[str] = []

    def add_marker(self, mark: pytest.MarkDecorator) -> None:
        assert mark.name == "xdist_group"
        self.groups.append(mark.args[0])


def test_modules_are_grouped_and_the_heaviest_units_go_first():
    light = "tests/unit/test_not_listed.py"
    lora = "tests/integration/test_lora.py"
    bench = "tests/integration/test_bench.py"
    items = [Item(f"{light}::test_a"), Item(f"{bench}::test_gateway_bench_json"),
             Item(f"{bench}::test_rerender_bench_json"), Item(f"{light}::test_b"),
             Item(f"{lora}::test_three_lora_steps_of_the_real_model")]
    distribute(items)  # type: ignore[arg-type]
    assert [i.nodeid.split("/")[-1] for i in items] == [
        "test_lora.py::test_three_lora_steps_of_the_real_model",
        "test_bench.py::test_rerender_bench_json",  # 60 s, a unit of its own
        "test_not_listed.py::test_a", "test_not_listed.py::test_b",  # unlisted: file order
        "test_bench.py::test_gateway_bench_json"]
    groups = {i.nodeid: i.groups for i in items}
    assert groups[f"{light}::test_a"] == groups[f"{light}::test_b"] == [light]
    assert groups[f"{bench}::test_rerender_bench_json"] == []  # APART: each test alone


def test_every_listed_module_and_test_exists():
    for key in [*SECONDS, *APART]:
        path, _, name = key.partition("::")
        assert (REPO / path).is_file(), key
        if name:
            assert f"def {name}(" in (REPO / path).read_text(), key

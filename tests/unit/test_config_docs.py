"""docs/configuration.md is config/default.yaml rendered: every key, default and comment."""

from __future__ import annotations

import re

import yaml

from app.config.loader import DEFAULT_CONFIG_PATH, flat_keys
from app.config.reference import render
from tests.conftest import REPO


def test_the_page_is_the_rendered_defaults():
    page = (REPO / "docs" / "configuration.md").read_text()
    assert page == render(), "regenerate it: carryover config docs > docs/configuration.md"


def test_every_key_is_documented_with_a_meaning():
    rows = re.findall(r"^\| `([\w.]+)` \| `[^`]*` \| (.*) \|$", render(), flags=re.M)
    documented = {key for key, _ in rows}
    assert documented == set(flat_keys(yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())))
    assert [key for key, meaning in rows if not meaning.strip()] == []

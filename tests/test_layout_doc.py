"""docs/layout-api.md lists every public field, property and method of the layout objects a
connector receives: a table per class, one row per name (first column, in backticks). A name added
to a class and not to its table fails here."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from kvtool.manager.layer_groups import BufferId
from kvtool.manager.layout import KvCacheLayerGroupLayout, KvCacheLayout, KvCacheRegion, PoolGroupLayout, PoolLayout

DOC = Path(__file__).parents[1] / "docs" / "layout-api.md"
CLASSES = [KvCacheLayout, KvCacheLayerGroupLayout, KvCacheRegion, PoolGroupLayout, PoolLayout, BufferId]


def public_names(cls: type) -> set[str]:
    """Fields (dataclass or NamedTuple), properties and methods the class itself defines."""
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(cls._fields)
    own = {name for name, value in vars(cls).items()
           if isinstance(value, property) or inspect.isfunction(value)}
    return {n for n in fields | own if not n.startswith("_")}


def documented(cls: type) -> set[str]:
    """The names in the first column of the class's table (`name(args)` counts as `name`)."""
    section = re.search(rf"^### `{cls.__name__}`\n(.*?)(?=^### |\Z)", DOC.read_text(), re.M | re.S)
    assert section, f"docs/layout-api.md has no section for {cls.__name__}"
    cells = re.findall(r"^\| ([^|]+) \|", section.group(1), re.M)
    return {re.sub(r"\(.*", "", name) for cell in cells for name in re.findall(r"`([^`]+)`", cell)}


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_public_name_of_a_layout_object_is_documented(cls):
    missing = public_names(cls) - documented(cls)
    assert not missing, f"{cls.__name__}: add {sorted(missing)} to docs/layout-api.md"
    stale = documented(cls) - public_names(cls)
    assert not stale, f"{cls.__name__}: docs/layout-api.md lists {sorted(stale)}, which the class does not have"


def test_a_new_field_would_fail():
    """The check itself can fail: a class with one more field than its table."""
    @dataclasses.dataclass(frozen=True)
    class PoolLayout2(PoolLayout):
        new_field: int = 0
    PoolLayout2.__name__ = "PoolLayout"
    assert public_names(PoolLayout2) - documented(PoolLayout2) == {"new_field"}

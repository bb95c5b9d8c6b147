"""The one accessor of what a connector's scheduler says of itself: the typed method, or nothing;
a connector with only the retired dict hook is refused at load, saying what to write instead."""

from __future__ import annotations

import pytest

from kvtool.connector.introspection import Introspectable, Introspection, introspect
from kvtool.connectors.registry import load_connector
from kvtool.errors import InputError


class Typed:
    def kvtool_introspection(self) -> Introspection:
        return Introspection(tracked_request_ids=(3,), pinned_entries=1)


class DictHook:
    def kvtool_introspect(self) -> dict:
        return {"tracked_request_ids": [4, 5], "saved_blocks": 2, "something_else": "ignored"}


def test_a_typed_scheduler_is_read_by_its_method():
    assert isinstance(Typed(), Introspectable)
    assert introspect(Typed()) == Introspection(tracked_request_ids=(3,), pinned_entries=1)


def test_the_retired_dict_hook_is_never_read():
    assert introspect(DictHook()) is None


def test_a_connector_with_only_the_retired_hook_is_refused_at_load(tmp_path):
    path = tmp_path / "retired.py"
    path.write_text("from kvtool.connectors.host import HostConnectorScheduler, HostConnectorWorker\n"
                    "class Old(HostConnectorScheduler):\n"
                    "    kvtool_introspection = None\n"
                    "    def kvtool_introspect(self):\n"
                    "        return {}\n")
    with pytest.raises(InputError, match=r"Old.kvtool_introspect\(\) \(a dict\) is no longer read: define "
                                         r"kvtool_introspection\(\) returning"):
        load_connector(f"{path}:Old:HostConnectorWorker")


def test_a_scheduler_that_says_nothing_is_accepted():
    assert introspect(object()) is None


def test_the_dict_form_holds_only_what_was_said():
    said = Introspection(tracked_request_ids=(1,), loaded_blocks=0)
    assert said.as_dict() == {"tracked_request_ids": [1], "loaded_blocks": 0}

"""The one accessor of what a connector's scheduler says of itself: the typed method, the older
dict hook converted, or nothing."""

from __future__ import annotations

from kvtool.connector.introspection import Introspectable, Introspection, introspect


class Typed:
    def kvtool_introspection(self) -> Introspection:
        return Introspection(tracked_request_ids=(3,), pinned_entries=1)


class DictHook:
    def kvtool_introspect(self) -> dict:
        return {"tracked_request_ids": [4, 5], "saved_blocks": 2, "something_else": "ignored"}


def test_a_typed_scheduler_is_read_by_its_method():
    assert isinstance(Typed(), Introspectable)
    assert introspect(Typed()) == Introspection(tracked_request_ids=(3,), pinned_entries=1)


def test_the_dict_hook_is_converted_and_unknown_keys_ignored():
    assert introspect(DictHook()) == Introspection(tracked_request_ids=(4, 5), saved_blocks=2)


def test_a_scheduler_that_says_nothing_is_accepted():
    assert introspect(object()) is None


def test_the_dict_form_holds_only_what_was_said():
    said = Introspection(tracked_request_ids=(1,), loaded_blocks=0)
    assert said.as_dict() == {"tracked_request_ids": [1], "loaded_blocks": 0}
    assert Introspection.from_mapping(said.as_dict()) == said

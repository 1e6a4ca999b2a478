"""The seam's protocol is the one list of what an engine must and may implement: the required
methods are read from it, and an engine that leaves an optional member out gets the default
declared there."""

from __future__ import annotations

import pytest

from pytest_kvcanary.canary.seam import (OPTIONAL_MEMBERS, REQUIRED_METHODS, EngineUnderTest, RowOwners, missing_methods,
                                         optional)


def test_the_required_methods_are_the_protocols_less_the_optional_ones():
    assert REQUIRED_METHODS == ("canary_groups", "canary_capacities", "cache_walk", "set_forward_hooks", "generate",
                                "reset")
    assert all(hasattr(EngineUnderTest, name) for name in OPTIONAL_MEMBERS)


class _Bare:
    """Every required method, no optional member."""

    def __getattr__(self, name: str):
        if name in REQUIRED_METHODS:
            return lambda *args, **kwargs: None
        raise AttributeError(name)


class _Full(_Bare):
    prefix_caching = False

    def __init__(self) -> None:
        self.listeners: list = []

    def add_free_listener(self, listener) -> None:
        self.listeners.append(listener)

    def request_at(self, row: int, step: int) -> tuple[str, str] | None:
        return (f"r{row}", f"step {step}")

    def finished_requests(self) -> int | None:
        return 7


def test_an_engine_without_the_optional_members_gets_the_declared_defaults():
    engine = _Bare()
    assert missing_methods(engine) == []
    assert optional(engine, "prefix_caching") is True
    assert optional(engine, "add_free_listener") is None
    assert optional(engine, "feed_token") is None
    assert optional(engine, "request_at")(3, 4) is None
    assert optional(engine, "finished_requests")() is None


def test_an_engine_with_the_optional_members_keeps_its_own():
    engine = _Full()
    assert optional(engine, "prefix_caching") is False
    optional(engine, "add_free_listener")(print)
    assert engine.listeners == [print]
    assert optional(engine, "request_at")(3, 4) == ("r3", "step 4")
    assert optional(engine, "finished_requests")() == 7


def test_missing_methods_names_what_lacks_in_protocol_order():
    class Half:
        def canary_groups(self): ...
        def generate(self): ...
        reset = None  # not callable

    assert missing_methods(Half()) == ["canary_capacities", "cache_walk", "set_forward_hooks", "reset"]


def test_a_name_that_is_not_an_optional_member_is_an_error():
    with pytest.raises(ValueError, match=f"^name must be one of {', '.join(OPTIONAL_MEMBERS)}; got 'generate'$"):
        optional(_Full(), "generate")


def test_row_owners_name_who_held_a_row_at_each_forward() -> None:
    owners: RowOwners[str] = RowOwners()
    owners.note(0, 2, "a")
    owners.note(0, 3, "a")  # the holder again: still held since forward 2
    owners.note(0, 5, "b")
    owners.note(1, 0, "c")
    assert [owners.at(0, step) for step in range(7)] == [None, None, "a", "a", "a", "b", "b"]
    assert owners.at(1, 9) == "c" and owners.at(2, 9) is None
    owners.clear()
    assert owners.at(0, 6) is None

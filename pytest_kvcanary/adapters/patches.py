"""Patches: the attributes of an engine's objects an adapter replaces (transformers_cb, vllm), and
the hooks it registers, recorded so that they are undone together. Nothing is patched at import: a
patch is installed by the engine that needs it, when it starts, and undone by ``uninstall`` when
the engine is closed."""

from __future__ import annotations

from typing import Any, Callable

_ABSENT = object()  # the object had no attribute of its own by that name (a method of its class)


class Patches:
    """A record of replaced attributes and of other undo steps (a hook's removal), undone last
    first."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def replace(self, obj: Any, name: str, value: Any) -> None:
        """obj.name = value; uninstall puts back what obj held itself (or drops the attribute, so
        its class's method shows again)."""
        previous = vars(obj).get(name, _ABSENT)
        setattr(obj, name, value)
        self._undo.append(lambda: delattr(obj, name) if previous is _ABSENT else setattr(obj, name, previous))

    def wrap(self, obj: Any, name: str, make: Callable[[Any], Any]) -> None:
        """obj.name = make(obj.name as it is now)."""
        self.replace(obj, name, make(getattr(obj, name)))

    def after(self, obj: Any, name: str, then: Callable[..., None]) -> None:
        """Call then(*args, **kwargs) after obj.name(*args, **kwargs) returns."""
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                result = original(*args, **kwargs)
                then(*args, **kwargs)
                return result
            return wrapped

        self.wrap(obj, name, make)

    def on_uninstall(self, undo: Callable[[], None]) -> None:
        """Run undo when the patches are undone (in turn, last recorded first)."""
        self._undo.append(undo)

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

"""Patches, and the vLLM adapter's use of them: every vLLM object the adapter changes (the model's
forward pre-hook, each attention layer impl's ``do_kv_cache_update``, the sliding-window managers'
``remove_skipped_blocks``) is recorded in the engine's Patches, and ``VllmEngine.close()`` puts
each back and drops the engine from the connector's registry, as does a start-up that fails. The
Patches tests need no vLLM."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pytest_kvcanary.adapters.patches import Patches

from .support import INSTALL, make_engine, unsupported


class Thing:
    def method(self) -> str:
        return "class"


def test_replace_puts_back_what_the_object_held_itself():
    thing = Thing()
    thing.own = "own"
    patches = Patches()
    patches.replace(thing, "own", "patched")
    patches.replace(thing, "method", lambda: "patched")
    patches.replace(thing, "added", "patched")
    assert (thing.own, thing.method(), thing.added) == ("patched", "patched", "patched")
    patches.uninstall()
    assert thing.own == "own" and thing.method() == "class"
    assert "method" not in vars(thing) and not hasattr(thing, "added")


def test_wrap_and_after_see_the_attribute_as_it_is_then():
    thing, calls = Thing(), []
    patches = Patches()
    patches.wrap(thing, "method", lambda original: lambda: f"wrapped {original()}")
    patches.after(thing, "method", lambda *args: calls.append(args))
    assert thing.method() == "wrapped class" and calls == [()]
    patches.uninstall()
    assert thing.method() == "class" and "method" not in vars(thing)


def test_uninstall_undoes_last_first_and_once():
    order: list[str] = []
    target = SimpleNamespace(value=0)
    patches = Patches()
    patches.replace(target, "value", 1)
    patches.on_uninstall(lambda: order.append(f"hook saw {target.value}"))
    patches.replace(target, "value", 2)
    patches.uninstall()
    assert order == ["hook saw 1"] and target.value == 0
    patches.uninstall()
    assert order == ["hook saw 1"] and target.value == 0


# vLLM ------------------------------------------------------------------------------------------


def _impls(engine) -> list:
    layers = engine.llm.llm_engine.vllm_config.compilation_config.static_forward_context
    return [layers[name].impl for name in engine._kv_caches]


def _window_managers(engine) -> list:
    return [engine.book.manager.coordinator.single_type_managers[g] for g in engine.book.window_groups]


def _our_hooks(engine) -> list:
    return [hook for hook in engine._runner.model._forward_pre_hooks.values()
            if getattr(hook, "__func__", None) is type(engine)._model_called]


@pytest.mark.parametrize("attention", ["mha", "swa", "mla"])
def test_close_puts_back_every_vllm_object_it_patched(attention):
    pytest.importorskip("vllm", reason=INSTALL)
    if reason := unsupported(attention):
        pytest.skip(reason)
    from pytest_kvcanary.adapters.vllm.connector import registry

    engine = make_engine(attention, num_blocks=40)
    assert engine.generate([[1, 2, 3, 4, 5]], 3)  # the patched paths run
    model, impls, windows = engine._runner.model, _impls(engine), _window_managers(engine)
    assert impls and all("do_kv_cache_update" in vars(impl) for impl in impls)
    assert bool(windows) == (attention == "swa")
    assert all("remove_skipped_blocks" in vars(single) for single in windows)
    hooks = len(model._forward_pre_hooks)
    assert len(_our_hooks(engine)) == 1
    assert engine._key in registry

    engine.close()

    assert len(model._forward_pre_hooks) == hooks - 1 and not _our_hooks(engine)
    for impl in impls:
        assert "do_kv_cache_update" not in vars(impl)
        assert impl.do_kv_cache_update.__func__ is type(impl).do_kv_cache_update
    for single in windows:
        assert "remove_skipped_blocks" not in vars(single)
        assert single.remove_skipped_blocks.__func__ is type(single).remove_skipped_blocks
    assert engine._key not in registry
    engine.close()  # a second close does nothing
    assert len(model._forward_pre_hooks) == hooks - 1


def test_a_failed_start_up_puts_back_what_it_patched(monkeypatch):
    """Start-up fails after write-through wrapped every layer (before the pre-hook): the engine
    closes itself, so no layer keeps the wrap and the registry keeps no entry."""
    pytest.importorskip("vllm", reason=INSTALL)
    from pytest_kvcanary.adapters.vllm import engine as engine_module
    from pytest_kvcanary.adapters.vllm.connector import registry

    seen: dict = {}
    real = engine_module.pool_groups

    def failing(layers, kv_caches, *args, **kwargs):
        real(layers, kv_caches, *args, **kwargs)
        seen["impls"] = [layers[name].impl for name in kv_caches]
        assert all("do_kv_cache_update" in vars(impl) for impl in seen["impls"])
        raise RuntimeError("start-up failed")

    monkeypatch.setattr(engine_module, "pool_groups", failing)
    before = set(registry._adapters)
    with pytest.raises(RuntimeError, match="start-up failed"):
        make_engine("mha", num_blocks=24)
    assert seen["impls"] and all("do_kv_cache_update" not in vars(impl) for impl in seen["impls"])
    assert set(registry._adapters) <= before

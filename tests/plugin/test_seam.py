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


def test_an_engine_that_subclasses_the_protocol_gets_the_same_defaults() -> None:
    """Inheriting the protocol's declarations is leaving the members out: a method not offered
    stays not offered, the others keep their default bodies and values."""
    from pytest_kvcanary.canary.seam import Capabilities, capabilities_of

    class Subclassed(EngineUnderTest):
        def canary_groups(self): ...
        def canary_capacities(self): ...
        def cache_walk(self): ...
        def set_forward_hooks(self, hooks): ...
        def generate(self, prompts, max_new_tokens): ...
        def reset(self): ...

    engine = Subclassed()
    assert [name for name in OPTIONAL_MEMBERS if optional(engine, name) is None] == [
        "add_free_listener", "feed_token", "host_tier", "serve", "score_uncached"]
    assert optional(engine, "engine_defects")() == [] and optional(engine, "checkpoint_walk")() is None
    assert capabilities_of(engine) == Capabilities()


def test_every_optional_callable_is_a_typed_method_with_a_documented_default() -> None:
    """Optional members that are calls are methods declared on the protocol, annotated, whose
    docstring says what an engine that leaves them out gets; the rest are data with a value."""
    import inspect

    for name in OPTIONAL_MEMBERS:
        member = inspect.getattr_static(EngineUnderTest, name)
        if not inspect.isfunction(member):
            assert name in ("host_tier", "prefix_caching", "routed_experts"), name
            continue
        hints = inspect.signature(member)
        assert hints.return_annotation is not inspect.Signature.empty, name
        assert all(p.annotation is not inspect.Parameter.empty for p in list(hints.parameters.values())[1:]), name
        doc = " ".join((member.__doc__ or "").split())
        assert doc.startswith("Optional"), name
        assert "default" in doc.lower(), f"{name}: the docstring names no default"


# ------------------------------------------------------------------ one module to import from

SEAM_MODULE = "pytest_kvcanary.canary.seam"
# The paths the docs gave each type before the seam re-exported it: they keep working, and name
# the very objects the seam does.
OLD_PATHS = {
    "pytest_kvcanary.canary.seam_data": ("PoolGroup", "Capacities", "CacheWalk", "PagedWalk", "CheckpointWalk",
                                    "HostPool", "Arrival", "TokenScores", "EngineDefect", "SlotMapping",
                                    "ForwardView", "GroupInputs", "StateInputs", "copy_runs", "page_entries"),
    "kvcanary_kernels.inputs": ("SlotMapping", "ForwardView", "GroupInputs", "StateInputs"),
    "kvcanary_kernels.records": ("GroupKind", "Half", "PREV_CHAIN_HEAD", "UNKNOWN"),
    "pytest_kvcanary.soak.seam_types": ("Arrival", "TokenScores", "EngineDefect"),
    "pytest_kvcanary": ("UnsupportedAttention",),
}
# The module the data types had before "host" came to mean CPU memory only.
OLD_PATHS["pytest_kvcanary.canary.host"] = OLD_PATHS["pytest_kvcanary.canary.seam_data"]
# What an adapter imports from the seam: its data types and the page helpers, wherever they are
# defined.
ADAPTER_NAMES = ("PoolGroup", "SlotMapping", "ForwardView", "GroupInputs", "StateInputs", "Capacities", "CacheWalk",
                 "PagedWalk", "CheckpointWalk", "HostPool", "HostTier", "HostTierListener", "FreeListener",
                 "Arrival", "TokenScores", "EngineDefect", "GroupKind", "Half", "PREV_CHAIN_HEAD", "UNKNOWN",
                 "page_entries", "copy_runs", "Capabilities", "ForwardHooks", "EngineUnderTest", "GuardedEngine",
                 "PrefillDecodePair", "TransferListener", "UnsupportedAttention", "RowOwners")


def test_every_name_of_the_seam_imports_from_it() -> None:
    import importlib

    seam = importlib.import_module(SEAM_MODULE)
    assert len(seam.__all__) == len(set(seam.__all__))
    assert [name for name in seam.__all__ if not hasattr(seam, name)] == []
    assert set(ADAPTER_NAMES) <= set(seam.__all__)
    namespace: dict[str, object] = {}
    exec(f"from {SEAM_MODULE} import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(seam.__all__)


@pytest.mark.parametrize("module", sorted(OLD_PATHS))
def test_the_documented_old_paths_still_import_the_same_objects(module: str) -> None:
    import importlib

    seam, old = importlib.import_module(SEAM_MODULE), importlib.import_module(module)
    assert {name: getattr(old, name) is getattr(seam, name) for name in OLD_PATHS[module]} == \
        dict.fromkeys(OLD_PATHS[module], True)


def test_the_engine_protocols_old_name_is_the_same_protocol() -> None:
    from pytest_kvcanary.canary import seam

    assert seam.CanaryHost is seam.GuardedEngine and "CanaryHost" not in seam.__all__


def test_the_settings_old_path_still_imports() -> None:
    from pytest_kvcanary.plugin import run_settings as old
    from pytest_kvcanary.settings import run_settings

    assert old is run_settings


def test_importing_the_whole_seam_loads_neither_torch_nor_triton() -> None:
    """A conftest imports every name of the seam at module level: no torch, no triton, no kernel
    code, nothing of the runtime or the plugin."""
    import subprocess
    import sys

    code = (f"import sys; from {SEAM_MODULE} import *; import {SEAM_MODULE} as seam; "
            "assert all(n in globals() for n in seam.__all__); "
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'numpy') "
            "or (m.startswith('kvcanary_kernels.') and m not in "
            "('kvcanary_kernels.records', 'kvcanary_kernels.checks', 'kvcanary_kernels.inputs')) "
            "or (m.startswith('pytest_kvcanary.') and m not in ('pytest_kvcanary.canary', "
            f"'{SEAM_MODULE}', 'pytest_kvcanary.canary.seam_data', 'pytest_kvcanary.soak', "
            "'pytest_kvcanary.soak.seam_types'))); "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def _seam_type_imports() -> list[str]:
    """Imports of an adapter-facing type from where it is defined rather than from the seam, in the
    project's adapters, the worked adapters (examples/adapter) and the toy engine."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    defined_elsewhere = {"canary.host", "canary.seam_data", "kvcanary_kernels.inputs", "kvcanary_kernels.records", "soak.seam_types"}
    found = []
    adapters = [*(root / "pytest_kvcanary" / "adapters").rglob("*.py"), *(root / "examples" / "adapter").glob("*.py")]
    for path in sorted(adapters):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and any(
                    node.module == m or node.module.endswith("." + m) for m in defined_elsewhere):
                found.append(f"{path.relative_to(root)}:{node.lineno}: from {'.' * node.level}{node.module}")
    return found


def test_adapters_import_their_types_from_the_seam_only() -> None:
    found = _seam_type_imports()
    assert not found, "import these from pytest_kvcanary.canary.seam:\n" + "\n".join(found)


def test_an_adapter_written_from_the_seam_alone_runs(realtester: pytest.Pytester) -> None:
    """An adapter whose one import of the plugin is the seam is a whole engine: this one (one pool,
    one request at a time, a prefill and decode steps) runs a guarded test, and a fault on it is
    caught."""
    realtester.makepyfile(tiny_engine='''
        import torch

        from pytest_kvcanary.canary.seam import (Capabilities, Capacities, ForwardHooks, ForwardView, GroupKind,
                                                 PoolGroup, SlotMapping, UnsupportedAttention)


        class Tiny:
            def __init__(self):
                self.k, self.v = torch.zeros(64, 1, 16), torch.zeros(64, 1, 16)
                self.table = torch.zeros(1, 32, dtype=torch.int64)
                self.hooks: ForwardHooks | None = None

            def canary_groups(self):
                return [PoolGroup(GroupKind.FULL, [self.k], [self.v], 64, SlotMapping(self.table))]

            def canary_capacities(self):
                return Capacities(max_batch=1, max_tokens=32, max_context=32)

            def cache_walk(self):
                return None

            def capabilities(self):
                return Capabilities(prefix_cache=False, cache_walk=False, concurrent=False)

            def set_forward_hooks(self, hooks):
                self.hooks = hooks

            def reset(self):
                pass

            def generate(self, prompts, max_new_tokens):
                outputs = []
                for prompt in prompts:  # a prefill, then decode steps that read the prefix
                    tokens = list(prompt.encode() if isinstance(prompt, str) else prompt)[:32 - max_new_tokens]
                    prefix, new = 0, tokens
                    for _ in range(max_new_tokens):
                        tokens.append(self._forward(prefix, new))
                        prefix, new = len(tokens) - 1, tokens[-1:]
                    outputs.append(tokens[-max_new_tokens:])
                return outputs

            def _forward(self, prefix, new):
                n = len(new)
                self.table[0, prefix:prefix + n] = torch.arange(prefix + 1, prefix + n + 1)
                view = ForwardView(torch.tensor([0]), torch.tensor([prefix]), torch.tensor([n]), torch.tensor(new),
                                   torch.arange(prefix, prefix + n))
                if self.hooks:
                    self.hooks.before_forward(view)
                slots = self.table[0, prefix:prefix + n]
                self.k[slots] = (view.input_ids * 100 + view.positions).float().view(n, 1, 1)
                self.v[slots] = -self.k[slots]
                if self.hooks:
                    self.hooks.after_forward(view)
                    self.hooks.end_forward()
                return int(self.k[self.table[0, :prefix + n]].sum()) % 256


        def pytest_kvcanary_make_engine(spec):
            if spec.name == "tiny":
                if spec.attention != "mha":
                    raise UnsupportedAttention(f"the tiny engine has no {spec.attention} attention")
                return Tiny()
    ''')
    realtester.makepyfile(test_tiny='''
        import pytest

        def test_clean(kv_engine, kv_canary):
            assert len(kv_engine.generate(["hello there"], max_new_tokens=4)[0]) == 4
            kv_canary.assert_no_violation()

        @pytest.mark.kv_perturb("req_to_token", warmup_steps=1)
        def test_a_wrong_mapping_entry_is_caught(kv_engine, kv_canary):
            kv_engine.generate(["hello there"], max_new_tokens=4)
            kv_canary.assert_violation("verify_chain_hash", phase="HEAD")
    ''')
    realtester.syspathinsert()
    result = realtester.runpytest_subprocess("-p", "tiny_engine", "--kv-canary", "--kv-canary-engine=tiny",
                                             "--kv-canary-device=cpu", "-rs")
    result.assert_outcomes(passed=2)

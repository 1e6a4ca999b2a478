"""Parse and validate a test's kv_perturb, kv_attention, kv_canary, kv_parallel and kv_pd markers (no torch).

Every error is a `MarkerError` whose message shows the marker as written, the bad argument or
value, and the allowed values; the plugin turns it into an error of that one test. A marker set
on a test that uses none of the fixtures it acts through is `ignored`: the plugin warns.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest

from kvcanary_kernels.checks import is_int
from kvcanary_kernels.records import GroupKind

from ..config import ATTENTION_KINDS, PD_TRANSPORTS, PERTURB_MODES, CanaryConfig, PerturbSpec
from ..perturb.fit import misfit

# Registered in pytest_configure, so `pytest --markers` lists them and --strict-markers accepts them.
MARKER_LINES = (
    "kv_perturb(mode, *, prob=1.0, side=None, target_group=None, warmup_steps=0, rank=None): inject a KV "
    f"fault into the test's engine (on a parallel engine: on every rank, or on `rank` only), one marker per "
    f"fault; modes: {', '.join(PERTURB_MODES)}",
    f"kv_attention(*kinds): attention kinds of the test's engine ({', '.join(ATTENTION_KINDS)}); "
    "several kinds parametrize the test",
    "kv_canary(**overrides): canary settings for this test (fields of CanaryConfig); "
    "command-line options win, except for mode",
    "kv_parallel(tp=1, pp=1): run the test's engine with tp tensor-parallel ranks and pp pipeline "
    "stages, one process and one canary per rank; --kv-canary-tp / --kv-canary-pp on the command line win",
    f"kv_pd(*, transport='local'): how the test's prefill/decode pair moves KV ({', '.join(PD_TRANSPORTS)}: "
    "each engine in a process of its own, over torch.distributed); --kv-canary-pd-transport on the command line wins",
)
PARALLEL_FIELDS = ("tp", "pp")

DEFAULT_ATTENTION = ATTENTION_KINDS[0]

# The fixtures each kv marker acts through.
_ENGINE_FIXTURES = ("kv_engine", "kv_pd", "kv_canary")
MARKER_FIXTURES = {
    "kv_perturb": _ENGINE_FIXTURES,
    "kv_canary": _ENGINE_FIXTURES,
    "kv_attention": (*_ENGINE_FIXTURES, "kv_attention_kind"),
    "kv_parallel": _ENGINE_FIXTURES,
    "kv_pd": ("kv_pd",),
}


class MarkerError(ValueError):
    """A kv marker has an argument it does not accept."""


class KvMarkerWarning(pytest.PytestWarning):
    """A kv marker on a test that uses none of the fixtures it acts through: it does nothing."""


def _show(mark: pytest.Mark) -> str:
    parts = [repr(a) for a in mark.args] + [f"{k}={v!r}" for k, v in mark.kwargs.items()]
    return f"{mark.name}({', '.join(parts)})"


def _perturb(mark: pytest.Mark, pd: bool) -> PerturbSpec:
    allowed = [f.name for f in fields(PerturbSpec)]
    kwargs = dict(mark.kwargs)
    if len(mark.args) > 1 or (mark.args and "mode" in kwargs):
        raise MarkerError(f"{_show(mark)}: takes one mode; allowed modes: {', '.join(PERTURB_MODES)}")
    if mark.args:
        kwargs["mode"] = mark.args[0]
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise MarkerError(f"{_show(mark)}: unknown keyword {unknown[0]!r}; allowed: {', '.join(allowed[1:])}")
    if "mode" not in kwargs:
        raise MarkerError(f"{_show(mark)}: needs a mode; allowed modes: {', '.join(PERTURB_MODES)}")
    try:
        spec = PerturbSpec(**kwargs)
    except ValueError as e:
        raise MarkerError(f"{_show(mark)}: {e}") from None
    if spec.side is not None and not pd:
        raise MarkerError(f"{_show(mark)}: side={spec.side!r} needs the kv_pd fixture; kv_engine has one side")
    return spec


def perturbs(node: pytest.Item, *, pd: bool, ranks: int = 1) -> tuple[PerturbSpec, ...]:
    """One spec per kv_perturb marker on the test, its class and its module. `pd`: whether the
    test drives a prefill/decode pair (only then may a fault name a side); ranks: how many ranks
    the test's engine has (a fault's rank must be one of them)."""
    specs = []
    for mark in node.iter_markers("kv_perturb"):
        spec = _perturb(mark, pd)
        if spec.rank is not None and spec.rank >= ranks:
            raise MarkerError(f"{_show(mark)}: rank={spec.rank} is not a rank of the test's engine, which has "
                              f"{ranks} (ranks 0 to {ranks - 1}; kv_parallel(tp=..., pp=...) makes more)")
        specs.append(spec)
    return tuple(specs)


def check_perturbs_fit(node: pytest.Item, *, groups: tuple[str, ...], canary: CanaryConfig, engine: str) -> None:
    """MarkerError unless every kv_perturb marker fits the engine the test got (`perturb.fit`)
    and the canary settings it runs with: real_kv_unused_cache damages slots only the prefix cache
    holds, which only the sweep reads, so it needs sweep_interval >= 1. `groups`: the engine's
    pool groups by label; engine: how the error names the engine (e.g. "reference/swa")."""
    kinds = tuple(GroupKind.from_label(label) for label in groups)
    for mark in node.iter_markers("kv_perturb"):
        spec = _perturb(mark, pd=True)
        why = misfit(spec, kinds, fingerprints_real_kv=canary.real_data != "none", engine=f"engine {engine!r}")
        if why is None and spec.mode == "real_kv_unused_cache" and canary.sweep_interval == 0:
            why = ("it damages slots only the prefix cache holds, which only the sweep reads, and sweep_interval=0 "
                   "turns the sweep off: set sweep_interval >= 1")
        if why is not None:
            raise MarkerError(f"{_show(mark)}: {why}")


def attention_kinds(node: pytest.Item) -> tuple[str, ...]:
    """The kinds of the test's one kv_attention marker (on it, its class or its module); ("mha",)
    without one. Two markers, or a kind named twice, are an error."""
    marks = list(node.iter_markers("kv_attention"))
    if not marks:
        return (DEFAULT_ATTENTION,)
    if len(marks) > 1:
        raise MarkerError(f"{' and '.join(_show(m) for m in reversed(marks))} apply to this test; kv_attention "
                          "markers do not combine: give the test one marker naming every kind it runs")
    mark = marks[0]
    if mark.kwargs or not mark.args:
        raise MarkerError(f"{_show(mark)}: takes one or more kinds; allowed kinds: {', '.join(ATTENTION_KINDS)}")
    for kind in mark.args:
        if kind not in ATTENTION_KINDS:
            raise MarkerError(f"{_show(mark)}: kind must be one of {', '.join(ATTENTION_KINDS)}; got {kind!r}")
    if len(set(mark.args)) < len(mark.args):
        twice = next(kind for kind in mark.args if mark.args.count(kind) > 1)
        raise MarkerError(f"{_show(mark)}: names {twice!r} twice; name each kind once (each runs the test once)")
    return tuple(mark.args)


def ignored(node: pytest.Item) -> list[str]:
    """What to warn about the kv markers set on the test itself (not on its class or module) that
    act through none of the fixtures it uses: one message per marker, naming it and the test."""
    used = set(getattr(node, "fixturenames", ()))
    return [f"{_show(mark)} on {node.nodeid} does nothing: the test uses none of the fixtures it acts through "
            f"({', '.join(MARKER_FIXTURES[mark.name])})"
            for mark in node.own_markers if mark.name in MARKER_FIXTURES and not used & set(MARKER_FIXTURES[mark.name])]


def canary_overrides(node: pytest.Item) -> dict[str, Any]:
    """The CanaryConfig fields set by kv_canary markers; a marker closer to the test wins."""
    merged: dict[str, Any] = {}
    for mark in reversed(list(node.iter_markers("kv_canary"))):
        if mark.args:
            raise MarkerError(f"{_show(mark)}: takes keyword arguments only (fields of CanaryConfig)")
        try:
            CanaryConfig().with_overrides(**mark.kwargs)
        except ValueError as e:
            raise MarkerError(f"{_show(mark)}: {e}") from None
        merged.update(mark.kwargs)
    return merged


def parallel(node: pytest.Item) -> dict[str, int]:
    """The tp / pp the closest kv_parallel marker sets (only those it names)."""
    mark = node.get_closest_marker("kv_parallel")
    if mark is None:
        return {}
    if mark.args:
        raise MarkerError(f"{_show(mark)}: takes keyword arguments only: tp, pp")
    for name, value in mark.kwargs.items():
        if name not in PARALLEL_FIELDS:
            raise MarkerError(f"{_show(mark)}: unknown keyword {name!r}; allowed: {', '.join(PARALLEL_FIELDS)}")
        if not is_int(value) or value < 1:
            raise MarkerError(f"{_show(mark)}: {name} must be an integer >= 1; got {value!r}")
    return dict(mark.kwargs)


def pd_transport(node: pytest.Item) -> dict[str, str]:
    """The transport the closest kv_pd marker sets ({} without one)."""
    mark = node.get_closest_marker("kv_pd")
    if mark is None:
        return {}
    if mark.args or set(mark.kwargs) - {"transport"}:
        unknown = [repr(a) for a in mark.args] + sorted(set(mark.kwargs) - {"transport"})
        raise MarkerError(f"{_show(mark)}: takes the keyword transport only; got {unknown[0]}")
    if "transport" in mark.kwargs and mark.kwargs["transport"] not in PD_TRANSPORTS:
        raise MarkerError(f"{_show(mark)}: transport must be one of {', '.join(PD_TRANSPORTS)}; "
                          f"got {mark.kwargs['transport']!r}")
    return dict(mark.kwargs)

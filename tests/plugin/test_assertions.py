"""The kv_canary assertion API over a scripted handle."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

import pytest

from pytest_kvcanary.assertions import KvCanary
from pytest_kvcanary.canary.violation import Violation
from pytest_kvcanary.config import TARGET_GROUPS, PerturbSpec

PD = ("prefill", "decode")


def _violation(side: str = "decode", step: int = 1, phase: str = "HEAD", group: str = "FULL", half: str = "K",
               reasons: tuple[str, ...] = ("verify_real_kv_hash",)) -> Violation:
    return Violation(side, step, phase, half, group, reasons, 17, 3, 0, 0xDEAD, 0xBEEF)


@dataclass
class _Injection:
    status: str
    cause: str = ""
    mode: str = "real_kv_post_forward"
    side: str = "prefill"
    group: str = "full"
    slot: int = 17
    position: int = 3
    row: int = 0
    half: str | None = "K"
    layer: int = 0
    byte: int = 0
    step: int = 0


@dataclass
class _Handle:
    logged: list[Violation] = field(default_factory=list)
    ledger: list[Any] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)
    forwards: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PD, 6))

    def violations(self) -> list[Violation]:
        return self.logged

    def injections(self) -> list[Any]:
        return self.ledger

    def prompts_since_reset(self) -> list[str]:
        return self.prompts

    def request_label(self, violation: Violation) -> str | None:
        return {0: "req 7 'Once upon a time'"}.get(violation.row)

    def stats(self) -> dict[str, dict[str, Any]]:
        return {side: {"forwards": n} for side, n in self.forwards.items()}


def _canary(sides: tuple[str, ...] = PD, perturbs: tuple[PerturbSpec, ...] = (), **handle: Any) -> KvCanary:
    return KvCanary(_Handle(**handle), sides, perturbs)


def test_filters_match_case_insensitively_and_on_any_reason() -> None:
    head = _violation(reasons=("verify_chain_hash", "verify_position"))
    sweep = _violation(side="prefill", phase="SWEEP", group="SWA", half="V")
    canary = _canary(logged=[head, sweep])
    assert canary.violations() == [head, sweep]
    assert canary.violations("verify_position") == [head]
    assert canary.violations(phase="sweep", group="swa", half="v", side="prefill") == [sweep]
    assert canary.violations(phase="Head", side="DECODE") == [head]
    assert canary.violations("verify_token") == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"reason": "verify_hash"}, "reason must be one of verify_chain_hash, verify_position, verify_real_kv_hash, "
                                    "verify_token, write_token, write_position, verify_missing_slot, "
                                    "reserved_slot_written, write_real_kv_hash, walk_duplicate_slot, "
                                    "walk_slot_out_of_range, walk_too_large, walk_position_gap, "
                                    "view_out_of_range, rank_divergence, verify_scale, verify_index; got 'verify_hash'"),
        ({"phase": "BODY"}, "phase must be one of HEAD, TAIL, SWEEP, RECHECK, SELECT; got 'BODY'"),
        ({"group": "local"}, f"group must be one of {', '.join(TARGET_GROUPS)}; got 'local'"),
        ({"side": "single"}, "side must be one of prefill, decode; got 'single'"),
        ({"half": "Q"}, "half must be one of K, V; got 'Q'"),
    ],
)
def test_bad_names_list_the_allowed_values(kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError) as e:
        _canary().violations(**kwargs)
    assert str(e.value) == message


def test_sides_follow_the_handle() -> None:
    canary = _canary(sides=("single",), logged=[_violation(side="single")])
    assert canary.violations(side="single")
    with pytest.raises(ValueError, match="side must be one of single; got 'decode'"):
        canary.assert_no_violation(side="decode")


def test_assert_violation_returns_the_matches() -> None:
    match = _violation()
    canary = _canary(logged=[match, _violation(side="prefill")])
    assert canary.assert_violation("verify_real_kv_hash", side="decode", phase="HEAD", group="full") == [match]


def test_within_steps_counts_forwards_since_the_reset() -> None:
    canary = _canary(logged=[_violation(step=3)])
    assert canary.assert_violation("verify_real_kv_hash", within_steps=4)
    with pytest.raises(AssertionError, match=r"expected a verify_real_kv_hash violation \(within_steps=3\), found none"):
        canary.assert_violation("verify_real_kv_hash", within_steps=3)
    with pytest.raises(ValueError, match="within_steps must be an integer >= 1; got 0"):
        canary.assert_violation("verify_real_kv_hash", within_steps=0)


def test_missing_violation_explains_escaped_faults() -> None:
    escaped = _Injection("escaped", cause="slot freed by radix dedup before any read")
    canary = _canary(logged=[_violation(side="prefill", reasons=("verify_chain_hash",))], ledger=[escaped],
                     prompts=["p", "p"])
    with pytest.raises(AssertionError) as e:
        canary.assert_violation("verify_real_kv_hash", side="decode")
    lines = str(e.value).splitlines()
    assert lines[0] == "expected a verify_real_kv_hash violation (side=decode), found none"
    assert lines[1] == ("escaped: real_kv_post_forward on prefill full slot 17 at step 0: "
                        "slot freed by radix dedup before any read")
    assert lines[2].startswith("hint: the radix cache dedups identical prompts")
    assert lines[3] == "violations (1):"
    assert "verify_chain_hash" in lines[5]
    assert lines[6] == "ledger (1 injection):"
    assert lines[8].split()[-9:] == ["escaped", "slot", "freed", "by", "radix", "dedup", "before", "any", "read"]


def test_require_distinct_prompts_fails_at_once() -> None:
    canary = _canary(logged=[_violation()], prompts=["a", "b", "a"])
    with pytest.raises(AssertionError, match=r"1 prompt\(s\) were sent more than once since the reset, e\.g\. 'a': "
                                             r"the radix cache dedups .* distinct_prompts=True"):
        canary.assert_violation("verify_real_kv_hash", require_distinct_prompts=True)
    assert _canary(logged=[_violation()], prompts=["a", "b"]).assert_violation(
        "verify_real_kv_hash", require_distinct_prompts=True)


def test_assert_no_violation_shows_the_tables() -> None:
    canary = _canary(logged=[_violation(side="decode")], ledger=[_Injection("detected")])
    canary.assert_no_violation(side="prefill")
    with pytest.raises(AssertionError) as e:
        canary.assert_no_violation()
    text = str(e.value)
    assert text.startswith("expected no violation, found 1\nviolations (1):\n")
    assert "ledger (1 injection):" in text and "0xdead" in text


def test_assert_perturbations_detected() -> None:
    _canary(ledger=[_Injection("detected")]).assert_perturbations_detected()
    with pytest.raises(AssertionError, match="no fault was injected since the reset"):
        _canary().assert_perturbations_detected()
    canary = _canary(ledger=[_Injection("detected"), _Injection("latent"), _Injection("escaped", cause="overwritten")])
    with pytest.raises(AssertionError) as e:
        canary.assert_perturbations_detected()
    assert str(e.value).splitlines()[:3] == [
        "2 of 3 injected faults were not detected",
        "latent: real_kv_post_forward on prefill full slot 17 at step 0",
        "escaped: real_kv_post_forward on prefill full slot 17 at step 0: overwritten",
    ]


def test_perturbations_is_the_ledger() -> None:
    ledger = [_Injection("latent")]
    assert _canary(ledger=ledger).perturbations() == ledger


def test_tables_name_the_request_beside_the_row() -> None:
    sweep = Violation("decode", 4, "SWEEP", "K", "FULL", ("verify_real_kv_hash",), 17, 3, -1, 0xDEAD, 0xBEEF)
    canary = _canary(logged=[_violation(), sweep])
    with pytest.raises(AssertionError) as e:
        canary.assert_no_violation()
    lines = str(e.value).splitlines()
    assert lines[2].split() == ["side", "step", "phase", "half", "group", "reasons", "slot", "pos", "row", "request",
                                "stored", "expected"]
    assert lines[3].split()[8:] == ["0", "req", "7", "'Once", "upon", "a", "time'", "0xdead", "0xbeef"]
    assert lines[4].split()[8:] == ["-1", "-", "0xdead", "0xbeef"]


def test_without_labels_the_table_has_no_request_column() -> None:
    canary = _canary(logged=[_violation(side="prefill")])
    canary._handle.request_label = lambda v: None
    with pytest.raises(AssertionError) as e:
        canary.assert_no_violation()
    assert "request" not in str(e.value).splitlines()[2]


def test_reading_the_log_marks_the_violations_as_the_tests_own() -> None:
    reads = (lambda c: c.violations(), lambda c: c.perturbations(), lambda c: c.assert_violation("verify_real_kv_hash"))
    for read in reads:
        canary = _canary(logged=[_violation()])
        assert not canary.consulted
        read(canary)
        assert canary.consulted


def test_the_error_an_assertion_raised_is_remembered_when_it_shows_the_tables() -> None:
    canary = _canary(logged=[_violation()], prompts=["a", "a"])
    with pytest.raises(AssertionError) as distinct:
        canary.assert_violation("verify_real_kv_hash", require_distinct_prompts=True)
    assert canary.raised is None and "violations (" not in str(distinct.value)
    with pytest.raises(AssertionError) as e:
        canary.assert_no_violation()
    assert canary.raised is e.value


@pytest.mark.parametrize("perturbs, why", [
    ((), "the test has no kv_perturb marker"),
    ((PerturbSpec("real_kv_unused_cache"),),
     "kv_perturb('real_kv_unused_cache'): no slot qualified in any of the 12 forwards after its warm-up; it needs a "
     "slot the prefix cache holds and no running request reads (a finished request's prompt, while other requests "
     "run)"),
    ((PerturbSpec("real_kv_used", prob=0.5, side="decode", warmup_steps=2),),
     "kv_perturb('real_kv_used', prob=0.5, side='decode', warmup_steps=2): its probability (0.5) kept it off, or no "
     "slot qualified in any of the 4 forwards after its warm-up; it needs a slot a forward reads (*)"),
    ((PerturbSpec("req_to_token", warmup_steps=8, side="prefill"), PerturbSpec("real_kv_post_forward", warmup_steps=6)),
     "kv_perturb('req_to_token', side='prefill', warmup_steps=8): its warm-up of 8 forwards outlasted the test's "
     "forwards (6 on prefill); kv_perturb('real_kv_post_forward', warmup_steps=6): its warm-up of 6 forwards "
     "outlasted the test's forwards (6 on prefill, 6 on decode)"),
], ids=["no-marker", "no-slot", "probability", "warm-up"])
def test_no_injection_says_what_kept_each_fault_off(perturbs: tuple[PerturbSpec, ...], why: str) -> None:
    with pytest.raises(AssertionError) as e:
        _canary(perturbs=perturbs).assert_perturbations_detected()
    first = str(e.value).splitlines()[0]
    assert fnmatch.fnmatchcase(first, f"no fault was injected since the reset: {why}"), first


def test_rank_filters_a_parallel_engines_violations_and_the_tables_name_the_rank() -> None:
    from dataclasses import replace

    on_rank_1 = replace(_violation(), rank=1, stage=0)
    diverged = replace(_violation(phase="TAIL", reasons=("rank_divergence",)), rank=1, stage=0, peer=0, row=-1)
    canary = KvCanary(_Handle(logged=[replace(_violation(side="prefill"), rank=0, stage=0), on_rank_1, diverged]),
                      PD, ranks=2)
    assert canary.violations(rank=1) == [on_rank_1, diverged]
    assert canary.assert_violation("rank_divergence", rank=1) == [diverged]
    with pytest.raises(ValueError, match="rank must be a rank of the test's engine, 0 to 1; got 2"):
        canary.violations(rank=2)
    with pytest.raises(AssertionError) as e:
        canary.assert_no_violation(rank=1)
    lines = str(e.value).splitlines()
    assert lines[0] == "expected no violation (rank=1), found 2"
    assert lines[2].split()[:2] == ["side", "rank"] and lines[5].split()[:2] == ["decode", "1"]
    assert "vs rank 0" in lines[5]


def test_an_engine_of_one_rank_is_rank_0() -> None:
    canary = _canary(logged=[_violation()])
    assert canary.violations(rank=0) == [_violation()]
    with pytest.raises(ValueError, match="0 to 0; got 1"):
        canary.violations(rank=1)


def test_assert_violation_needs_a_reason() -> None:
    """None would mean "any reason" and read "expected a None violation": an error naming the
    argument instead, whether or not violations were logged."""
    for logged in ([], [_violation()]):
        with pytest.raises(ValueError, match=r"^reason must be one of .*; got None \(any violation at all: assert "
                                             r"kv_canary.violations\(\)\)$"):
            _canary(logged=logged).assert_violation(None)

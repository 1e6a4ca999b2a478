"""An engine the project does not know runs the stock examples and the soak (the conformance suite of
docs/adapters.md) with 0 failures: what it lacks skips, naming the capability; what it has is
checked. Each friction a first adapter author met has a test here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pytest_kvcanary.canary.seam import PoolGroup
from pytest_kvcanary.canary.seam import Capabilities, GroupKind, SlotMapping, capabilities_of
from pytest_kvcanary.config import PerturbSpec
from pytest_kvcanary.perturb.fit import lacking

ADAPTERS = Path(__file__).parents[2] / "examples" / "adapter"
TOY = (ADAPTERS / "toy_engine.py").read_text()


def run_toy(tester: pytest.Pytester, *args: str, **files: str) -> pytest.RunResult:
    tester.makepyfile(toy_engine=TOY, **files)
    tester.syspathinsert()
    return tester.runpytest_subprocess("-p", "toy_engine", "--kv-canary", "--kv-canary-engine=toy", "-rs", *args)


def test_the_conformance_command_runs_the_stock_examples_on_the_toy(realtester: pytest.Pytester) -> None:
    """The documented --pyargs command finds the installed examples; on an engine without a prefix
    cache the shared-prefix example and the sweep's fault skip naming the capability (they failed)."""
    result = run_toy(realtester, "--pyargs", "kvcanary_examples", "-k", "test_baseline or test_faults")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0 and outcomes.get("errors", 0) == 0 and outcomes["passed"] >= 3, outcomes
    result.stdout.fnmatch_lines([
        "*needs an engine with prefix_cache; the single engine (ToyEngine) declares prefix_cache=False*",
        "*kv_perturb('real_kv_unused_cache') needs an engine whose prefix cache the sweep can walk "
        "(GuardedEngine.cache_walk); the single engine (ToyEngine) has none*",
    ])


def test_the_soak_says_what_its_default_oracle_proves_and_the_engine_line_counts_its_forwards(
        realtester: pytest.Pytester) -> None:
    result = run_toy(realtester, "--kv-canary-soak-rounds=2", "--pyargs", "pytest_kvcanary.soak.suite", "-k", "mha")
    result.assert_outcomes(passed=1, skipped=1)  # the PD soak: no pair of the toy
    result.stdout.fnmatch_lines([
        "toy/single/mha on cpu * single: forwards=[1-9]* protected_tokens=[1-9]*",
        "workload soak: 1 soak, 2 rounds, * forwards: 2 clean",
        "  oracle: each request generated alone after a reset, compared exactly: proves nothing on this engine "
        "beyond repeatability*concurrent=False, prefix_cache=False*",
    ])


SLOT_ZERO_TOY = (
    "import toy_engine\n"
    "from pytest_kvcanary.canary.seam import Capabilities\n"
    "def from_zero(method):\n"
    "    def run(self, *args, **kwargs):\n"
    "        method(self, *args, **kwargs)\n"
    "        self.next_slot = 0  # every slot holds a token: slot 0 first\n"
    "    return run\n"
    "toy_engine.ToyEngine.__init__ = from_zero(toy_engine.ToyEngine.__init__)\n"
    "toy_engine.ToyEngine.reset = from_zero(toy_engine.ToyEngine.reset)\n"
    "toy_engine.ToyEngine.capabilities = lambda self: Capabilities(prefix_cache=False, cache_walk=False, "
    "spare_slot={spare})\n\n"
    "def test_it(kv_engine, kv_canary):\n"
    "    kv_engine.generate(['a prompt', 'and another one'], 3)\n"
    "    kv_canary.assert_no_violation()\n")


def test_an_engine_without_a_spare_slot_runs_with_slot_zero_unguarded(realtester: pytest.Pytester) -> None:
    """An engine that stores a token in slot 0 and says so (spare_slot=False) runs clean, warned that
    slot 0 is unguarded; the same engine not saying so trips the sentinel at slot 0 (mutation: the
    sentinel checked whatever the declaration)."""
    result = run_toy(realtester, test_spare=SLOT_ZERO_TOY.format(spare=False))
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*SlotZeroUnguarded: ToyEngine declares spare_slot=False: the tokens its pools hold "
                                 "at slot 0*are not guarded*allot one slot the engine never stores a token in*"])
    undeclared = run_toy(realtester, test_spare=SLOT_ZERO_TOY.format(spare=True))
    undeclared.assert_outcomes(failed=1)
    undeclared.stdout.fnmatch_lines(["*reserved_slot_written*", "*verify_missing_slot*"])


def test_a_forward_fed_another_token_is_caught_on_an_engine_serving_one_request_at_a_time(
        realtester: pytest.Pytester) -> None:
    """Two requests served one after another write the same slots; their next_token_swap faults give
    identical TAIL rows that were dropped as repeats, leaving faults latent (mutation: the log's key
    without the step of a TAIL row)."""
    realtester.makepyfile(static_cache_engine=(ADAPTERS / "static_cache_engine.py").read_text(), test_swap='''
import pytest

@pytest.mark.kv_perturb("next_token_swap", warmup_steps=1)
def test_swap(kv_engine, kv_canary):
    kv_engine.send_parallel_requests(3, distinct_prompts=True, max_new_tokens=4)
    kv_canary.assert_violation("write_token", phase="TAIL", group="full")
    kv_canary.assert_perturbations_detected()
    assert len(kv_canary.perturbations()) > 3
''')
    realtester.syspathinsert()
    result = realtester.runpytest_subprocess("-p", "static_cache_engine", "--kv-canary", "--kv-canary-engine=static")
    result.assert_outcomes(passed=1)


def test_capabilities_are_derived_from_the_optional_members_unless_declared() -> None:
    class Bare:
        prefix_caching = False

    class Declared(Bare):
        def capabilities(self) -> Capabilities:
            return Capabilities(concurrent=False, feed_token=True)

    assert capabilities_of(Bare()) == Capabilities(prefix_cache=False, cache_walk=False)
    assert capabilities_of(Declared()).missing("concurrent", "prefix_cache", "feed_token") == ["concurrent"]
    with pytest.raises(ValueError, match="no capability 'prefix'"):
        Capabilities().missing("prefix")
    with pytest.raises(TypeError, match=r"Capabilities.concurrent must be True or False; got 1"):
        Capabilities(concurrent=1)  # type: ignore[arg-type]


def test_req_to_token_skips_where_one_block_holds_a_whole_request() -> None:
    """No mapping entry is read without being written there: the mode failed ("no injections")."""
    k = torch.zeros(3, 64, 16)
    mapping = SlotMapping(torch.zeros(1, 1, dtype=torch.int64), page_size=64)
    group = PoolGroup(GroupKind.FULL, [k], [k], 192, mapping)
    why = lacking(PerturbSpec("req_to_token"), object(), "the single engine", [group], max_context=64)
    assert why is not None and "one block of page_size=64 >= max_context=64" in why
    assert lacking(PerturbSpec("req_to_token"), object(), "the single engine", [group], max_context=128) is None


def test_page_size_is_given_once_in_the_mapping_and_read_from_the_buffers() -> None:
    table = torch.zeros(2, 4, dtype=torch.int64)
    paged = PoolGroup(GroupKind.FULL, [torch.zeros(8, 16, 32)], [], 128, SlotMapping(table, page_size=16))
    flat = PoolGroup(GroupKind.FULL, [torch.zeros(128, 32)], [], 128, SlotMapping(table, page_size=16))
    assert (paged.page_size, flat.page_size) == (16, 1)
    with pytest.raises(ValueError, match=r"num_slots=100 is not a whole number of slots per row of k_layers\[0\]"):
        PoolGroup(GroupKind.FULL, [torch.zeros(8, 16, 32)], [], 100, SlotMapping(table, page_size=16))


def test_a_head_major_buffer_is_refused_naming_it_and_what_to_hand_instead() -> None:
    """[batch, heads, positions, head_dim] (every transformers cache) was read as if its slots ran
    along dim 1, or refused naming an internal function."""
    k = torch.zeros(2, 4, 64, 16)
    table = torch.zeros(2, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"PoolGroup FULL v_layers\[1\] of shape \(2, 4, 64, 16\) and strides "
                                         r"\(4096, 1024, 16, 1\) is head-major.*\[v\[:, h\] for h in range\(4\)\]"):
        PoolGroup(GroupKind.FULL, [k[:, 0]], [k[:, 0], k], 128, SlotMapping(table, page_size=64))
    per_head = PoolGroup(GroupKind.FULL, [k[:, h] for h in range(4)], [k[:, h] for h in range(4)], 128,
                         SlotMapping(table, page_size=64))
    assert per_head.page_size == 64

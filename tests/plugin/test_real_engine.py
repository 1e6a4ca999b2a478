"""The plugin over the real harness and reference engine: what users read (failure sections,
request names, summaries and their sums, marker and engine errors, quiet fault-injection runs)
comes from what the engine and the canary really logged, not from a stand-in.

Runs use the torch reference kernels (bit-identical to the Triton ones, which the kernel tests
check) to stay fast on a CPU; the interpreter test runs the Triton kernels.
"""

from __future__ import annotations

import json
import re

import pytest

from pytest_kvcanary.config import CanaryConfig, PerturbSpec
from pytest_kvcanary.handles.protocol import Handle
from pytest_kvcanary.handles.single import EngineHandle
from pytest_kvcanary.handles.pool import EngineKey
from pytest_kvcanary.handles.start import start_engine
from pytest_kvcanary.handles.sided import BASE_PROMPT, PROMPT_SHOWN

def _handle(attention: str = "mha", **canary: object) -> EngineHandle:
    from pytest_kvcanary.adapters.reference import make_reference_engine

    return EngineHandle(make_reference_engine(attention, "cpu", 0), CanaryConfig(**{"kernels": "torch", **canary}))


def test_handles_implement_the_handle_protocol() -> None:
    handle = _handle()
    pd = start_engine(EngineKey("pd", CanaryConfig(kernels="torch"), "reference", "mha", "cpu", seed=0))
    assert isinstance(handle, Handle) and isinstance(pd, Handle)
    assert (handle.side_names, pd.side_names) == (("single",), ("prefill", "decode"))
    assert handle.pool_groups() == ("full",) and _handle("swa").pool_groups() == ("full", "swa")


COUNTERS = ("forwards", "protected_tokens", "sweeps", "violations", "rows", "dropped")


def test_reset_clears_log_ledger_and_counters_and_reseeds_the_faults() -> None:
    """After reset the handle reads as new: no violations, injections or prompts, zeroed counters
    and a healthy canary (a launch count kept across the reset would not match the device's);
    the same seed replays the same faults."""
    handle = _handle(sweep_interval=1)
    faults = (PerturbSpec("real_kv_used", warmup_steps=1),)

    def run(seed: int, perturbs: tuple[PerturbSpec, ...]) -> list:
        handle.reset(seed, perturbs)
        handle.send_parallel_requests(3, distinct_prompts=True, max_new_tokens=4)
        return [(i.slot, i.position, i.step, i.status) for i in handle.injections()]

    first = run(0, faults)
    assert first and handle.violations() and handle.prompts_since_reset()
    assert handle.stats()["single"]["forwards"] == 4 and handle.stats()["single"]["sweeps"] == 4

    handle.reset(1, ())
    assert handle.violations() == [] and handle.injections() == [] and handle.prompts_since_reset() == []
    stats = handle.stats()["single"]
    assert {k: stats[k] for k in COUNTERS} == dict.fromkeys(COUNTERS, 0)
    assert stats["health"] == "ok" and handle.healthy()
    assert run(1, ()) == [] and handle.violations() == [] and handle.healthy()
    assert handle.stats()["single"]["forwards"] == 4

    assert run(0, faults) == first


def test_generate_and_send_parallel_requests_reject_a_bare_string() -> None:
    handle = _handle()
    handle.reset(0, ())
    with pytest.raises(TypeError, match=r"prompts must be a sequence of prompts .* not one str; got 'hello'"):
        handle.generate("hello")
    with pytest.raises(TypeError, match=r"n must be an integer >= 1 \(the number of requests\); got '4'"):
        handle.send_parallel_requests("4")
    with pytest.raises(TypeError, match=r"prompts\[0\] must be a str or a list of token ids \(ints\); got int 123: "
                                        r"the token ids of one prompt go in a list of their own"):
        handle.generate([123])
    with pytest.raises(TypeError, match=r"prompts\[1\] must be a str or a list of token ids \(ints\); got list \['a'\]"):
        handle.generate([[1, 2], ["a"]])
    assert handle.prompts_since_reset() == [] and handle.stats()["single"]["forwards"] == 0


class _NoContexts:
    """An engine whose generate takes no context keys (like the transformers and vLLM adapters)."""

    def generate(self, prompts: list, max_new_tokens: int) -> list:
        raise AssertionError("not reached")


def test_context_keys_on_an_engine_without_contexts_say_so_by_name() -> None:
    from pytest_kvcanary.handles.protocol import check_context_keys

    with pytest.raises(TypeError, match=r"context_keys: engine '_NoContexts' has no contexts"):
        check_context_keys([1], ["a"], _NoContexts().generate, "_NoContexts")
    handle = _handle()
    handle.reset(0, ())
    with pytest.raises(TypeError, match=r"context_keys must be one int per prompt \(2\); got \[1\]"):
        handle.generate(["a", "b"], context_keys=[1])
    assert handle.generate(["a"], 1, context_keys=[3])


def test_the_failure_names_the_request_beside_the_row(realtester: pytest.Pytester) -> None:
    realtester.makepyfile("""
        import pytest

        @pytest.mark.kv_perturb("real_kv_used", warmup_steps=1)
        def test_fails(kv_engine, kv_canary):
            kv_engine.send_parallel_requests(3, distinct_prompts=True, max_new_tokens=3)
            kv_canary.assert_no_violation()
    """)
    result = realtester.runpytest("--kv-canary", "--kv-canary-report=kv.json")
    result.assert_outcomes(failed=1)
    (test,) = json.loads((realtester.path / "kv.json").read_text())["tests"]
    v = test["violations"][0]
    # "req <id> '<first 30 characters of the prompt>'"; prompts are "{i} {nonce} " + BASE_PROMPT.
    match = re.fullmatch(r"req (\d+) '((\d) (\d+) (.*))'", v["request"])
    assert match, v["request"]
    shown, tail = match.group(2), match.group(5)
    assert len(shown) == PROMPT_SHOWN and BASE_PROMPT.startswith(tail)
    out = result.stdout.str()
    assert f"  {v['request']}  " in out
    # The assertion's message shows the tables; the failure section does not repeat them.
    assert out.count(f"ledger ({len(test['injections'])} injections):") == 1
    assert out.count(f"violations ({len(test['violations'])}):") == 1
    result.stdout.fnmatch_lines(["*- kv-canary -*", "seed: 0", "replay: pytest *::test_fails --kv-canary=log *"])


def test_summary_lines_agree_with_the_per_test_numbers(realtester: pytest.Pytester) -> None:
    """Engines serve several tests; each engine line is the sum of its tests' counters, and the
    JSON report says the same."""
    realtester.makepyfile("""
        import pytest

        @pytest.mark.kv_canary(sweep_interval=2)
        @pytest.mark.parametrize("n", [2, 3, 4])
        @pytest.mark.kv_perturb("real_kv_used", warmup_steps=1)
        def test_faults(kv_engine, kv_canary, n):
            kv_engine.send_parallel_requests(n, distinct_prompts=True, max_new_tokens=n)
            kv_canary.assert_violation("verify_real_kv_hash")

        @pytest.mark.kv_canary(sweep_interval=2)
        def test_clean(kv_engine, kv_canary):
            kv_engine.send_parallel_requests(2, distinct_prompts=True, max_new_tokens=3)
            kv_canary.assert_no_violation()
    """)
    result = realtester.runpytest("--kv-canary", "--kv-canary-report=kv.json")
    result.assert_outcomes(passed=4)
    report = json.loads((realtester.path / "kv.json").read_text())
    (engine,) = report["engines"]
    tests = report["tests"]
    total = engine["sides"]["single"]
    assert engine["tests"] == 4
    for counter in ("forwards", "protected_tokens", "sweeps", "violations", "rows", "dropped"):
        assert total[counter] == sum(t["stats"]["single"][counter] for t in tests), counter
    assert total["violations"] == sum(len(t["violations"]) for t in tests) > 0
    assert all(t["stats"]["single"]["forwards"] > 0 for t in tests)
    line = (f"reference/single/mha on cpu [[]worker main, 4 tests[]] single: forwards={total['forwards']} "
            f"protected_tokens={total['protected_tokens']} sweeps={total['sweeps']} "
            f"violations={total['violations']} health=ok")
    result.stdout.fnmatch_lines([line, f"4 guarded tests, {total['violations']} violations ({total['violations']} "
                                       "owned by tests that injected or checked them, "
                                       "0 unexpected), 1 engine handle"])


def test_a_green_fault_injection_run_prints_no_warning(realtester: pytest.Pytester) -> None:
    realtester.makepyfile("""
        import pytest

        @pytest.mark.kv_attention("mha", "swa")
        @pytest.mark.kv_perturb("real_kv_used", target_group="full", warmup_steps=2)
        def test_caught_at_head(kv_engine, kv_canary):
            kv_engine.send_parallel_requests(4, distinct_prompts=True, max_new_tokens=5)
            kv_canary.assert_violation("verify_real_kv_hash", phase="HEAD", group="full")

        @pytest.mark.kv_canary(sweep_interval=0)
        @pytest.mark.kv_perturb("real_kv_post_forward", side="prefill", target_group="full")
        def test_transfer(kv_pd, kv_canary):
            kv_pd.send_parallel_requests(3, distinct_prompts=True, max_new_tokens=3)
            kv_canary.assert_violation("verify_real_kv_hash", side="decode")
            kv_canary.assert_no_violation(side="prefill")
    """)
    result = realtester.runpytest("--kv-canary", "-W", "error")
    result.assert_outcomes(passed=3)
    out = result.stdout.str()
    assert "warnings summary" not in out and "Warning" not in out and "unexpected violations" not in out
    result.stdout.fnmatch_lines(["3 guarded tests, * violations (* owned by tests that injected or checked them, "
                                 "0 unexpected), 3 engine handles (4 lines: a prefill/decode handle has two sides)"])


def test_unexpected_violations_are_one_summary_block(realtester: pytest.Pytester) -> None:
    """A test that neither injects nor asserts, on an engine whose slot gets damaged: log mode
    keeps it green, and the summary shows the violations once, with their requests."""
    realtester.makepyfile("""
        def test_damaged_by_the_engine(kv_engine):
            kv_engine.send_parallel_requests(2, distinct_prompts=True, max_new_tokens=2)
            pool = kv_engine.engine.pools.full
            for layer in pool.k_layers:  # an engine bug: every cached K row overwritten
                layer.add_(1)
            kv_engine.send_parallel_requests(2, distinct_prompts=True, max_new_tokens=2)
    """)
    result = realtester.runpytest("--kv-canary")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([
        "unexpected violations: * in 1 test that neither injected faults nor checked them with kv_canary",
        "*::test_damaged_by_the_engine (seed 0, single/mha on cpu):",
        "violations (*):",
        "*side*step*phase*half*group*reasons*slot*pos*row*",
    ])
    assert result.stdout.str().count("test_damaged_by_the_engine (seed 0") == 1


def test_a_fault_no_slot_qualified_for_says_so(realtester: pytest.Pytester) -> None:
    """One request: its prompt's slots are cached only after its last forward, so no forward
    finds a slot that only the prefix cache holds; the failure says that, not that the marker is
    missing."""
    realtester.makepyfile("""
        import pytest

        @pytest.mark.kv_perturb("real_kv_unused_cache")
        def test_unused_cache(kv_engine, kv_canary):
            kv_engine.generate(["one request"], max_new_tokens=2)
            kv_canary.assert_perturbations_detected()
    """)
    result = realtester.runpytest("--kv-canary")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "E*AssertionError: no fault was injected since the reset: kv_perturb('real_kv_unused_cache'): no slot "
        "qualified in any of the 2 forwards after its warm-up; it needs a slot the prefix cache holds and no running "
        "request reads (*)"])


@pytest.mark.parametrize("attention, marker, message", [
    ("mha", 'kv_perturb("real_kv_used", target_group="swa")',
     "kv_perturb('real_kv_used', target_group='swa'): target_group='swa' is not a pool group of engine "
     "'reference/mha'; its groups: full"),
    ("swa", 'kv_perturb("req_to_token")',
     "kv_perturb('req_to_token'): target_group is required: engine 'reference/swa' has pool groups full, swa; "
     "allowed: full, swa"),
])
def test_marker_and_engine_mismatches_are_marker_errors(realtester: pytest.Pytester, attention: str, marker: str,
                                                        message: str) -> None:
    realtester.makepyfile(f"""
        import pytest

        @pytest.mark.kv_attention("{attention}")
        @pytest.mark.{marker}
        def test_bad(kv_engine): pass

        @pytest.mark.kv_attention("{attention}")
        def test_good(kv_engine):
            kv_engine.generate(["fine"], max_new_tokens=1)
    """)
    result = realtester.runpytest("--kv-canary")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at setup of test_bad*", message])
    out = result.stdout.str()
    assert "Traceback" not in out and "replaced" not in out


ENGINE_HOOKS = """
from pytest_kvcanary.adapters.reference import make_reference_engine

def pytest_kvcanary_make_engine(spec):
    if spec.name == "broken":
        return object()
    if spec.name == "text":
        return "an engine"
    if spec.name == "mine":
        return make_reference_engine(spec.attention, spec.device, spec.seed)
"""
# The hook's separate arguments of earlier releases: still passed, with a DeprecationWarning.
OLD_STYLE_ENGINE_HOOKS = """
from pytest_kvcanary.adapters.reference import make_reference_engine

def pytest_kvcanary_make_engine(name, attention, device, seed):
    if name == "mine":
        return make_reference_engine(attention, device, seed)
"""


@pytest.mark.parametrize("name, outcome, message", [
    ("broken", {"errors": 1},
     "engine 'broken' (object) does not implement EngineUnderTest (pytest_kvcanary/canary/seam.py): missing "
     "canary_groups, canary_capacities, cache_walk, set_forward_hooks, generate, reset"),
    ("text", {"errors": 1},
     "engine 'text' (str) does not implement EngineUnderTest (pytest_kvcanary/canary/seam.py): missing "
     "canary_groups, canary_capacities, cache_walk, set_forward_hooks, generate, reset"),
    ("nope", {"errors": 1},
     "no engine named 'nope': --kv-canary-engine names reference, transformers, vllm or an engine a "
     "pytest_kvcanary_make_engine hook implementation returns"),
])
def test_engines_the_harness_cannot_use_error_the_test(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
                                                        name: str, outcome: dict, message: str) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the run sets it; restored after
    pytester.makeconftest(ENGINE_HOOKS)
    pytester.makepyfile("def test_a(kv_engine): pass\ndef test_b(kv_engine): pass\ndef test_c(kv_pd): pass")
    result = pytester.runpytest("--kv-canary", f"--kv-canary-engine={name}")
    result.assert_outcomes(**outcome)  # one error: the run stops after the first test, saying why
    result.stdout.fnmatch_lines([message, f"*Interrupted: --kv-canary-engine={name}: {message}*"])
    assert "Traceback" not in result.stdout.str()


@pytest.mark.parametrize("hooks", [ENGINE_HOOKS, OLD_STYLE_ENGINE_HOOKS], ids=["spec", "old-style"])
def test_kv_pd_skips_on_an_engine_without_a_pair(realtester: pytest.Pytester, hooks: str) -> None:
    realtester.makeconftest((realtester.path / "conftest.py").read_text() + hooks)
    realtester.makepyfile("""
        def test_single(kv_engine):
            assert kv_engine.generate(["a hook's engine"], max_new_tokens=1)

        def test_pd(kv_pd): pass
    """)
    result = realtester.runpytest("--kv-canary", "--kv-canary-engine=mine", "-rs")
    result.assert_outcomes(passed=1, skipped=1, warnings=0 if hooks == ENGINE_HOOKS else 1)
    result.stdout.fnmatch_lines(["SKIPPED * kv_pd needs a prefill/decode pair of engine 'mine', and none is known: *"
                                 "pytest_kvcanary_make_pd_pair hook*"])
    if hooks == OLD_STYLE_ENGINE_HOOKS:
        result.stdout.fnmatch_lines(["*DeprecationWarning: pytest_kvcanary_make_engine(spec) takes one argument*"])


def test_seam_types_in_a_conftest_and_the_triton_kernels_on_cpu(pytester: pytest.Pytester,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """What docs/adapters.md asks an engine author to write: a conftest that
    imports the seam types (and triton) at module level. The kv tests still run on the CPU with
    the Triton kernels, under the interpreter the plugin chose before the conftest loaded."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pytester.makeconftest("""
        from pytest_kvcanary.canary.seam import PoolGroup, ForwardView, SlotMapping
        from kvcanary_kernels.records import GroupKind
        import triton
    """)
    pytester.makepyfile("""
        import pytest

        @pytest.mark.kv_perturb("real_kv_used", warmup_steps=1)
        def test_guarded(kv_engine, kv_canary):
            kv_engine.send_parallel_requests(2, distinct_prompts=True, max_new_tokens=2)
            kv_canary.assert_violation("verify_real_kv_hash", phase="HEAD")
    """)
    pytester.runpytest_subprocess("--kv-canary").assert_outcomes(passed=1)


def test_bad_generate_arguments_do_not_retire_a_healthy_engine(realtester: pytest.Pytester) -> None:
    """Arguments a handle refuses before the engine runs leave the engine as it was: the next
    test gets the same handle, and the summary has no "(replaced: raised)" line."""
    realtester.makepyfile("""
        import pytest

        def test_bad_arguments(kv_engine):
            for call in (lambda: kv_engine.generate("one prompt"), lambda: kv_engine.generate(["a"], 0),
                         lambda: kv_engine.generate(["a"], max_new_tokens="2"),
                         lambda: kv_engine.send_parallel_requests(0),
                         lambda: kv_engine.run_workload(replay="0/0:-1.0+1.5*2@9")):
                with pytest.raises((TypeError, ValueError)):
                    call()

        def test_next(kv_engine):
            assert len(kv_engine.generate(["a"], 2)[0]) == 2
    """)
    result = realtester.runpytest("--kv-canary", "--kv-canary-report=kv.json")
    result.assert_outcomes(passed=2)
    assert "replaced" not in result.stdout.str()
    report = json.loads((realtester.path / "kv.json").read_text())
    assert [t["handle"] for t in report["tests"]] == [0, 0] and [e["retired"] for e in report["engines"]] == [None]

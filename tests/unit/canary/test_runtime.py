import contextlib
import os
import subprocess
import sys

import pytest
import torch

from kvcanary_kernels.records import FIELD_REAL_KV_HASH
from pytest_kvcanary.canary.health import KvCanaryHealthError
from pytest_kvcanary.canary.log import KvCanaryViolationError
from pytest_kvcanary.config import CanaryConfig


def _prefill_and_decode(host, steps: int = 3) -> None:
    host.forward({0: [5, 6, 7, 8], 1: [9, 10]})
    for i in range(steps):
        host.forward({0: [20 + i], 1: [30 + i]})


def _seen(host) -> set[tuple]:
    return {(v.phase, v.half, v.group, v.reasons, v.slot, v.position, v.row) for v in host.runtime.log.violations}


@pytest.mark.parametrize("real_data", ["none", "partial", "all"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("page", [1, 4])
def test_clean_run_with_shared_prefix_and_padding_reports_nothing(make_host, real_data, window, page):
    host = make_host(window=window, page=page, real_data=real_data, sweep_interval=2, write_through=True)
    _prefill_and_decode(host)
    host.forward({2: [40, 41]}, share={2: 0}, pad_to=5)  # row 2 reuses row 0's cached prefix
    host.cached = [(0, len(host.tokens[0])), (2, len(host.tokens[2]))]
    host.forward({2: [42], 0: [43]}, pad_to=8)
    host.runtime.sweep()
    stats = host.runtime.stats()
    assert host.runtime.log.violations == []
    assert stats.violations == 0 and stats.health == "ok"
    assert stats.forwards == 6 and stats.sweeps == 4  # 3 periodic + 1 explicit
    assert stats.protected_tokens == 6 + 2 * 3 + 2 + 2


def test_kv_byte_flipped_between_forwards_is_reported_at_head_on_the_k_half_at_that_slot(make_host):
    host = make_host(real_data="partial")
    _prefill_and_decode(host)
    slot = host.slot(0, 2)
    host.k[0].view(-1, 8).view(torch.uint8)[slot, 3] ^= 0x10
    host.forward({0: [99]})
    # RECHECK compares with what HEAD read: the forward itself changed nothing.
    assert _seen(host) == {("HEAD", "K", "FULL", ("verify_real_kv_hash",), slot, 2, 0)}
    assert {v.step for v in host.runtime.log.violations} == {4}


def test_recheck_rereads_the_deepest_sampled_layer_and_head_the_others_next_forward(make_host):
    host = make_host(real_data="all")
    _prefill_and_decode(host)
    deep, shallow = host.slot(0, 1), host.slot(0, 2)

    def stray_writes(written):  # one per layer; the fingerprint samples layers 0 and 1
        host.k[1].view(-1, 8)[deep] = 777
        host.k[0].view(-1, 8)[shallow] = 888

    host.forward({0: [99]}, during=stray_writes)
    assert _seen(host) == {("RECHECK", "K", "FULL", ("verify_real_kv_hash",), deep, 1, 0)}
    host.forward({0: [98]})
    assert _seen(host) - {("RECHECK", "K", "FULL", ("verify_real_kv_hash",), deep, 1, 0)} == {
        ("HEAD", "K", "FULL", ("verify_real_kv_hash",), slot, position, 0)
        for slot, position in ((deep, 1), (shallow, 2))}


@pytest.mark.parametrize("page", [1, 4])
def test_wrong_mapping_entry_is_reported_where_it_points_and_at_its_successor(make_host, page):
    host = make_host(real_data="none", page=page, recheck=False)
    _prefill_and_decode(host)
    if page == 1:
        host.table[0, 2] = host.table[1, 0]
        want = {(2, ("verify_position", "verify_token", "verify_chain_hash")), (3, ("verify_chain_hash",))}
    else:  # row 0's first block (positions 0..3) now points at row 1's: consistent inside, wrong tokens
        host.table[0, 0] = host.table[1, 0]
        want = {(p, ("verify_token",)) for p in range(4)} | {(4, ("verify_chain_hash",))}
    host.forward({0: [99]})
    got = {(v.half, v.position, v.reasons) for v in host.runtime.log.violations}
    assert got == {(half, p, r) for half in ("K", "V") for p, r in want}
    assert {v.phase for v in host.runtime.log.violations} == {"HEAD"}


def test_swa_head_checks_only_the_window(make_host):
    host = make_host(window=2, real_data="partial")
    _prefill_and_decode(host)
    outside = host.slot(0, 0)
    host.swa_k[0].view(torch.uint8)[outside, 0] ^= 1
    host.forward({0: [99]})
    assert host.runtime.log.violations == []  # the SWA group does not read position 0 any more
    inside = host.slot(0, len(host.tokens[0]) - 1)
    host.swa_k[0].view(torch.uint8)[inside, 0] ^= 1
    host.forward({0: [100]})
    assert {(v.group, v.slot, v.reasons) for v in host.runtime.log.violations} == {
        ("SWA", inside, ("verify_real_kv_hash",))}


def test_a_hole_inside_the_window_is_a_missing_slot_even_at_the_last_position(make_host):
    host = make_host(window=3, real_data="none")
    _prefill_and_decode(host)
    last = len(host.tokens[0]) - 1
    host.full_to_swa[host.slot(0, last)] = 0  # the SWA slot of row 0's newest token freed early
    host.forward({0: [99]})
    assert _seen(host) == {(phase, half, "SWA", ("verify_missing_slot",), 0, last, 0)
                           for phase in ("HEAD", "RECHECK") for half in ("K", "V")}


def test_damage_done_inside_a_forward_is_reported_by_the_recheck_of_that_forward(make_host):
    host = make_host(real_data="partial")
    _prefill_and_decode(host)
    victim = host.slot(1, 1)  # row 1 reads it in this forward

    def stray_write(written):  # a padding row writing a live slot
        host.v[1].view(-1, 8)[victim] = 12345

    host.forward({0: [99], 1: [98]}, during=stray_write)
    assert _seen(host) == {("RECHECK", "V", "FULL", ("verify_real_kv_hash",), victim, 1, 1)}
    assert {v.step for v in host.runtime.log.violations} == {4}


def test_kv_written_to_the_wrong_slot_fails_the_write_through_check(make_host):
    host = make_host(real_data="all", write_through=True)
    _prefill_and_decode(host)
    want = []

    def misplace(written):  # the forward's K of its first token also lands on its second slot
        k = host.k[0].view(-1, 8)
        k[written[1]] = k[written[0]]
        want.append(written[1])

    host.forward({2: [1, 2, 3]}, during=misplace)
    assert _seen(host) == {("TAIL", "K", "FULL", ("write_real_kv_hash",), want[0], 1, 2)}


def test_a_cache_hit_across_contexts_fails_at_position_0_with_token_checks_off(make_host):
    host = make_host(real_data="all", check_tokens=False)
    host.forward({0: [5, 6, 7]}, context_keys={0: 11})
    host.forward({1: [8]}, share={1: 0}, context_keys={1: 11})  # same context: clean
    assert host.runtime.log.violations == []
    host.forward({2: [9]}, share={2: 0}, context_keys={2: 22})
    heads = {(v.phase, v.reasons, v.slot, v.position, v.row) for v in host.runtime.log.violations if v.half == "K"}
    assert heads == {(phase, ("verify_chain_hash",), host.slot(0, 0), 0, 2) for phase in ("HEAD", "RECHECK")}


def test_a_write_into_the_reserved_slot_is_reported(make_host):
    host = make_host(real_data="partial")
    _prefill_and_decode(host)
    host.v[0].view(-1, 8)[0, 0] = 7  # a padding write of garbage into slot 0
    host.forward({0: [99]})
    assert {(v.reasons, v.slot, v.half) for v in host.runtime.log.violations} == {
        (("reserved_slot_written",), 0, "V")}
    host.runtime.reset()
    assert int(host.runtime.groups[0].halves[next(iter(host.runtime.groups[0].halves))]
               .records[0, FIELD_REAL_KV_HASH]) != 0


def test_a_token_that_disagrees_with_the_engines_bookkeeping_is_a_write_token(make_host):
    host = make_host(real_data="none")
    host.forward({0: [5, 6]})
    host.token_table[0, 2] = 77  # the engine believes position 2 holds 77; the forward feeds 88
    host.forward({0: [88]})  # forward() writes 88 into token_table: put 77 back inside the forward
    assert host.runtime.log.violations == []
    view_pos = len(host.tokens[0])

    def believe_other(written):
        host.token_table[0, view_pos] = 77

    host.forward({0: [88]}, during=believe_other)
    assert {(v.phase, v.reasons, v.position, v.stored, v.expected) for v in host.runtime.log.violations} == {
        ("TAIL", ("write_token",), view_pos, 88, 77)}


def test_sweep_sees_corruption_no_forward_reads(make_host):
    host = make_host(real_data="all", sweep_interval=0)
    host.forward({3: [1, 2, 3, 4]})
    host.cached = [(3, 4)]
    slot = host.slot(3, 1)
    host.v[0].view(-1, 8).view(torch.uint8)[slot, 40] ^= 0x80  # all: every byte of the first sampled layer
    host.forward({0: [7]})
    assert host.runtime.log.violations == []
    host.runtime.sweep()
    host.runtime.drain()
    assert _seen(host) == {("SWEEP", "V", "FULL", ("verify_real_kv_hash",), slot, 1, -1)}


def test_the_log_drains_every_drain_interval_and_on_read_and_loses_nothing(make_host):
    host = make_host(real_data="partial", drain_interval=4)
    _prefill_and_decode(host)  # 4 forwards: one periodic drain, nothing to report
    slot = host.slot(0, 1)
    host.k[0].view(-1, 8).view(torch.uint8)[slot, 0] ^= 1
    host.forward({0: [99]})  # forward 5 logs on the device; the next periodic drain is at 8
    assert host.runtime.log.violations == []
    new = host.runtime.drain()  # a read drains at once
    assert {(v.phase, v.slot) for v in new} == {("HEAD", slot)}
    for i in range(3):
        host.forward({0: [100 + i]})  # the same damage seen again: repeats, not new violations
    assert host.runtime.drain() == [] and len(host.runtime.log.violations) == 1
    assert host.runtime.log.repeats == 3
    repeated = host.runtime.log.repeated  # kept for the fault ledger, each at the forward that saw it
    assert [v.slot for v in repeated] == [slot] * 3 and len({v.step for v in repeated}) == 3


def test_periodic_polls_report_damage_without_a_drain(make_host):
    """Each forward leaves the ring's counter where a poll reads it without touching the device
    (CUDA); a poll that sees it moved snapshots the rows, which the next poll decodes."""
    host = make_host(real_data="partial", drain_interval=2)
    _prefill_and_decode(host)  # 4 forwards
    slot = host.slot(0, 1)
    host.k[0].view(-1, 8).view(torch.uint8)[slot, 0] ^= 1
    for i in range(4):  # forward 5 logs; the polls at forwards 6 and 8 see it, then decode it
        host.forward({0: [99 + i]})
    assert {(v.phase, v.slot) for v in host.runtime.log.violations} == {("HEAD", slot)}


def test_a_forward_that_sweeps_and_drains_synchronously_enters_its_device_work_once(make_host):
    host = make_host(sweep_interval=1, drain_interval=1)
    host.runtime.end_forward = lambda: None  # the forward below ends here, by hand
    host.forward({0: [1, 2, 3]})
    del host.runtime.end_forward
    entered = []

    @contextlib.contextmanager
    def device_work():
        entered.append(host.runtime.sweeps)
        yield

    host.runtime.end_forward(device_work)
    assert entered == [0] and host.runtime.sweeps == 1


def test_raise_mode_raises_at_the_drain(make_host):
    host = make_host(mode="raise", real_data="partial")
    _prefill_and_decode(host)
    host.table[0, 1], host.table[0, 2] = host.table[0, 2].clone(), host.table[0, 1].clone()
    with pytest.raises(KvCanaryViolationError) as info:
        host.forward({0: [99]})
    assert len(info.value.violations) == len(host.runtime.log.violations) > 0
    assert "verify_position" in str(info.value)


def test_ring_overflow_reports_the_true_total(make_host):
    host = make_host(real_data="none", ring_capacity=3, recheck=False)
    host.forward({0: list(range(1, 11))})
    host.table[0, :10] = host.table[0, :10].flip(0)
    host.forward({0: [99]})
    stats = host.runtime.stats()
    assert len(host.runtime.log.violations) == 3
    assert stats.rows > 3 and stats.dropped == stats.rows - 3


def test_health_check_catches_a_skipped_before_forward(make_host):
    host = make_host()
    _prefill_and_decode(host)
    host.runtime.check_health()
    view = host.forward({0: [1]})
    host.runtime.after_forward(view)  # a forward whose HEAD never ran
    host.runtime.end_forward()
    with pytest.raises(KvCanaryHealthError, match="HEAD/K/FULL ran 5 of 6 launches"):
        host.runtime.check_health()


def test_reset_clears_records_log_and_counters(make_host):
    host = make_host(real_data="partial")
    _prefill_and_decode(host)
    host.k[0].view(-1, 8).view(torch.uint8)[host.slot(0, 0), 0] ^= 1
    host.forward({0: [99]})
    assert host.runtime.log.violations
    host.runtime.reset()
    assert host.runtime.log.violations == [] and host.runtime.log.total == 0
    assert host.runtime.stats().forwards == 0 and host.runtime.health_problems() == []
    for group in host.runtime.groups:
        for half in group.halves.values():
            assert int(half.records[1:].abs().sum()) == 0
    host.forward({5: [1, 2]})
    assert host.runtime.stats().health == "ok" and host.runtime.log.violations == []


@pytest.mark.parametrize("field, value, allowed", [
    ("mode", "loud", "off, log, raise"),
    ("real_data", "most", "none, partial, all"),
    ("kernels", "cuda", "triton, torch"),
    ("sweep_interval", -1, ">= 0"),
    ("ring_capacity", 0, ">= 1"),
    ("drain_interval", 0, ">= 1"),
    ("check_tokens", "yes", "True or False"),
    ("recheck", 1, "True or False"),
])
def test_bad_config_names_field_value_and_allowed(field, value, allowed):
    with pytest.raises(ValueError) as info:
        CanaryConfig(**{field: value})
    assert field in str(info.value) and repr(value) in str(info.value) and allowed in str(info.value)


def test_violations_also_go_to_a_json_lines_file_another_process_can_read(make_host, tmp_path):
    from pytest_kvcanary.canary.log import read_jsonl

    path = tmp_path / "violations.jsonl"
    host = make_host(real_data="partial", jsonl_path=path)
    _prefill_and_decode(host)
    host.k[1].view(-1, 8).view(torch.uint8)[host.slot(1, 0), 0] ^= 4
    host.forward({1: [77]})
    assert read_jsonl(path) == host.runtime.log.violations != []
    assert read_jsonl(tmp_path / "missing.jsonl") == []


@pytest.mark.parametrize("page, window", [(1, 3), (4, None)])
def test_triton_kernels_report_what_the_references_report(make_host, page, window):
    """One damaged workload (a flipped byte, a misplaced write, a hole, a wrong mapping entry) on
    the Triton kernels and on the torch references: the same violations, clean until damaged."""

    def run(kernels: str) -> set[tuple]:
        host = make_host(window=window, page=page, real_data="all", write_through=True, kernels=kernels,
                         sweep_interval=2)
        _prefill_and_decode(host, steps=2)
        host.forward({2: [1, 2]}, share={2: 0}, pad_to=4)
        assert host.runtime.drain() == []
        host.k[1].view(-1, 8).view(torch.uint8)[host.slot(1, 1), 5] ^= 2
        host.table[0, 1] = host.table[1, 0]

        def misplace(written):
            host.v[0].view(-1, 8)[written[0]] = 1

        host.forward({0: [7], 2: [8]}, during=misplace)
        if window is not None:
            host.full_to_swa[host.slot(1, len(host.tokens[1]) - 1)] = 0
        host.forward({1: [9]})
        host.runtime.check_health()
        return {(v.step, v.phase, v.half, v.group, v.reasons, v.slot, v.position, v.row, v.stored, v.expected)
                for v in host.runtime.log.violations}

    reference = run("torch")
    assert len({v[4] for v in reference}) >= 3
    assert run("triton") == reference


def test_triton_kernels_on_a_cpu_without_the_interpreter_are_refused_naming_the_option():
    # A fresh process without TRITON_INTERPRET (the test process runs the interpreter): Triton would
    # compile for a GPU and fail deep in its driver at the first launch.
    script = (
        "from pytest_kvcanary.canary.runtime import CanaryRuntime\n"
        "from pytest_kvcanary.config import CanaryConfig\n"
        "from pytest_kvcanary.reference_engine import Engine, EngineConfig, ModelConfig\n"
        "engine = Engine(EngineConfig(model=ModelConfig(max_context=64), device='cpu'))\n"
        "CanaryRuntime(CanaryConfig(kernels='triton'), engine)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "ValueError: CanaryConfig.kernels is 'triton'" in done.stderr and "TRITON_INTERPRET=1" in done.stderr, \
        done.stderr[-2000:]

import warnings

import pytest
import torch

from pytest_kvcanary.canary.health import KvCanaryHealthError
from pytest_kvcanary.canary.log import KvCanaryViolationError, KvCanaryViolationWarning
from pytest_kvcanary.config import CanaryConfig


def _prefill_and_decode(host, steps: int = 3) -> None:
    host.forward({0: [5, 6, 7, 8], 1: [9, 10]})
    for i in range(steps):
        host.forward({0: [20 + i], 1: [30 + i]})


@pytest.mark.parametrize("real_data", ["none", "partial", "all"])
@pytest.mark.parametrize("window", [None, 3])
def test_clean_run_with_shared_prefix_reports_nothing(make_host, real_data, window):
    host = make_host(window=window, real_data=real_data, sweep_interval=2)
    _prefill_and_decode(host)
    host.forward({2: [40, 41]}, share={2: 0})  # row 2 reuses row 0's cached prefix
    host.cached = [(0, len(host.tokens[0])), (2, len(host.tokens[2]))]
    host.forward({2: [42], 0: [43]})
    host.runtime.sweep()
    stats = host.runtime.stats()
    assert host.runtime.log.violations == []
    assert stats.violations == 0 and stats.health == "ok"
    assert stats.forwards == 6 and stats.sweeps == 4  # 3 periodic + 1 explicit
    assert stats.protected_tokens > 0


def test_flipped_kv_byte_is_reported_at_head_on_the_k_half_at_that_slot(make_host):
    host = make_host(real_data="partial")
    _prefill_and_decode(host)
    slot = int(host.table[0, 2])
    host.k[0].view(torch.uint8)[slot, 3] ^= 0x10
    with pytest.warns(KvCanaryViolationWarning):
        host.forward({0: [99]})
    (v,) = host.runtime.log.violations
    assert (v.reasons, v.phase, v.half, v.group, v.slot, v.position, v.row) == (
        ("verify_real_kv_hash",), "HEAD", "K", "FULL", slot, 2, 0)
    assert v.step == 4


def test_wrong_mapping_is_reported_at_the_entry_and_its_successor(make_host):
    host = make_host(real_data="none")
    _prefill_and_decode(host)
    wrong = int(host.table[1, 0])
    host.table[0, 2] = wrong
    with pytest.warns(KvCanaryViolationWarning):
        host.forward({0: [99]})
    got = {(v.half, v.position, v.reasons) for v in host.runtime.log.violations}
    want = set()
    for half in ("K", "V"):
        want |= {(half, 2, ("verify_position", "verify_token", "verify_chain_hash")),
                 (half, 3, ("verify_chain_hash",))}
    assert got == want


def test_swa_head_checks_only_the_window(make_host):
    host = make_host(window=2, real_data="partial")
    _prefill_and_decode(host)
    outside = int(host.table[0, 0])
    host.swa_k[0].view(torch.uint8)[outside, 0] ^= 1
    host.forward({0: [99]})
    assert host.runtime.log.violations == []  # SWA group does not read position 0 any more
    inside = int(host.table[0, len(host.tokens[0]) - 1])
    host.swa_k[0].view(torch.uint8)[inside, 0] ^= 1
    with pytest.warns(KvCanaryViolationWarning):
        host.forward({0: [100]})
    (v,) = host.runtime.log.violations
    assert (v.group, v.slot, v.reasons) == ("SWA", inside, ("verify_real_kv_hash",))


def test_sweep_sees_corruption_no_forward_reads(make_host):
    host = make_host(real_data="all", sweep_interval=0)
    host.forward({3: [1, 2, 3, 4]})
    host.cached = [(3, 4)]
    slot = int(host.table[3, 1])
    host.v[1].view(torch.uint8)[slot, 40] ^= 0x80
    host.forward({0: [7]})
    assert host.runtime.log.violations == []
    host.runtime.sweep()
    with pytest.warns(KvCanaryViolationWarning):
        host.runtime.log.pump()
    (v,) = host.runtime.log.violations
    assert (v.phase, v.half, v.slot, v.position, v.row) == ("SWEEP", "V", slot, 1, -1)


def test_raise_mode_raises_with_every_new_row(make_host):
    host = make_host(mode="raise", real_data="partial")
    _prefill_and_decode(host)
    host.table[0, 1], host.table[0, 2] = host.table[0, 2].clone(), host.table[0, 1].clone()
    with pytest.raises(KvCanaryViolationError) as info:
        host.forward({0: [99]})
    assert len(info.value.violations) == len(host.runtime.log.violations) > 0
    assert "verify_position" in str(info.value)


def test_ring_overflow_reports_the_true_total(make_host):
    host = make_host(real_data="none", ring_capacity=3)
    host.forward({0: list(range(1, 11))})
    host.table[0, :10] = host.table[0, :10].flip(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
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
    with pytest.raises(KvCanaryHealthError, match="HEAD/K/FULL ran in 5 of 6 forwards"):
        host.runtime.check_health()


def test_reset_clears_records_log_and_counters(make_host):
    host = make_host()
    _prefill_and_decode(host)
    host.runtime.reset()
    assert host.runtime.stats().forwards == 0
    assert all(int(r.abs().sum()) == 0 for g in host.runtime.groups for r in g.records.values())


@pytest.mark.parametrize("field, value, allowed", [
    ("mode", "loud", "off, log, raise"),
    ("real_data", "most", "none, partial, all"),
    ("sweep_interval", -1, ">= 0"),
    ("ring_capacity", 0, ">= 1"),
    ("check_tokens", "yes", "True or False"),
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
    host.k[1].view(torch.uint8)[int(host.table[1, 0]), 0] ^= 4
    with pytest.warns(KvCanaryViolationWarning):
        host.forward({1: [77]})
    assert read_jsonl(path) == host.runtime.log.violations != []
    assert read_jsonl(tmp_path / "missing.jsonl") == []

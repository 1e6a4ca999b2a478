"""A prefill/decode pair decodes exactly what one engine does, and moves each slot's records with
its KV: under memory pressure, with duplicate and shared-prefix prompts, on one or two devices."""

from __future__ import annotations

import pytest
import torch

from pytest_kvcanary.canary.seam import TransferListener
from pytest_kvcanary.reference_engine.pd import PDPair
from pytest_kvcanary.handles.pd import PDHandle

from pd_support import assert_idle_and_whole, make_engine, make_handle


def mixed_prompts(seed: int, n: int) -> list[list[int]]:
    """n prompts of 5..60 tokens over three shared stems, with an exact duplicate and a prompt
    that is a prefix of another."""
    gen = torch.Generator().manual_seed(seed)
    stems = [torch.randint(0, 256, (int(torch.randint(4, 30, (1,), generator=gen)),), generator=gen).tolist()
             for _ in range(3)]
    prompts = []
    for i in range(n):
        tail = torch.randint(0, 256, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen).tolist()
        prompts.append(stems[i % 3] + tail)
    return prompts + [prompts[0], prompts[1][:-1]]


# (prefill, decode) engine settings: roomy; a decode side short of rows and memory (prefilled
# requests wait for room, decode retracts); a prefill side short of memory (radix eviction and,
# for swa, tombstoned prefixes whose SWA KV is not sent).
POOLS = {
    "roomy": ({}, {}),
    "tight_decode": ({}, {"num_slots": 160, "swa_num_slots": 96, "max_running": 3}),
    "tight_prefill": ({"num_slots": 200, "swa_num_slots": 72, "max_running": 4}, {}),
}


@pytest.mark.parametrize("pools", POOLS)
@pytest.mark.parametrize("attention", ["mha", "swa"])
def test_pd_outputs_equal_a_single_engine(attention, pools):
    prefill_kw, decode_kw = POOLS[pools]
    single = make_engine(attention, window=8)
    pair = PDPair(make_engine(attention, window=8, **prefill_kw), make_engine(attention, window=8, **decode_kw))
    for seed in (0, 1):
        prompts = mixed_prompts(seed, 8)
        expected = single.generate(prompts, 12)
        assert pair.generate(prompts, 12) == expected
        assert pair.generate(prompts[:3], 1) == [out[:1] for out in expected[:3]]
    for engine in (pair.prefill, pair.decode):
        assert_idle_and_whole(engine)
    if pools == "tight_decode":
        assert pair.decode.scheduler.num_retracted > 0, "decode never retracted"
    if pools == "tight_prefill":
        assert pair.prefill.radix_cache.num_evicted > 0, "prefill never evicted"
        if attention == "swa":
            assert pair.prefill.radix_cache.num_swa_evicted > 0, "prefill never tombstoned"


def test_decode_forwards_read_the_transferred_prefix_once_admitted():
    """The decode side never prefills a transferred request: its first forward is a decode whose
    prefix is the whole prompt, in slots its radix cache does not hold."""
    pair = PDPair(make_engine("mha"), make_engine("mha"))
    seen = []

    class Spy:
        def before_forward(self, view):
            seen.append((view.prefix_lens.tolist(), view.extend_lens.tolist(), pair.decode.cache_walk().slots.numel()))

        def kv_stored(self, kind, layer, k, v):
            pass

        def after_forward(self, view):
            pass

        def end_forward(self):
            pass

    pair.decode.set_forward_hooks(Spy())
    prompts = [list(b"a first prompt"), list(b"another, longer prompt")]
    pair.generate(prompts, 3)
    first = [len(p) for p in prompts]
    assert seen == [(first, [1, 1], 0), ([n + 1 for n in first], [1, 1], 0)]


def record_checker(handle: PDHandle, not_resident: list[int]) -> TransferListener:
    """A transfer listener (run after the handle's) asserting each transferred slot's records
    (every group, both halves) equal the sender's, and that a slot without an SWA copy on the
    prefill side is sent as zeros and gets none on the decode side (counted in not_resident)."""

    def check(src: torch.Tensor, dst: torch.Tensor) -> None:
        sent = handle.prefill.runtime.export_records(src)
        for sender, receiver, records in zip(handle.prefill.runtime.groups, handle.decode.runtime.groups, sent):
            src_slots, dst_slots = sender.to_group_slots(src), receiver.to_group_slots(dst)
            resident = src_slots != 0
            assert torch.equal(dst_slots != 0, resident)
            for half in sender.halves:
                assert torch.equal(receiver.halves[half].records[dst_slots[resident]],
                                   sender.halves[half].records[src_slots[resident]])
                assert not records[half][~resident].any()
            not_resident.append(int((~resident).sum()))

    return check


@pytest.mark.parametrize("attention", ["mha", "swa"])
def test_records_travel_with_the_kv(attention):
    handle = make_handle(attention, num_slots=200, swa_num_slots=72, max_running=4)
    not_resident: list[int] = []
    handle.pair.add_transfer_listener(record_checker(handle, not_resident))
    handle.reset(0, ())
    for seed in (0, 1):
        handle.generate(mixed_prompts(seed, 8), 4)
    assert len(not_resident) == 2 * 10 * len(handle.prefill.runtime.groups)
    assert handle.violations() == [] and handle.healthy()


def test_a_tombstoned_prefix_sends_no_swa_kv():
    """A prompt that reuses a cached prefix whose SWA slots were evicted (only its FULL KV is
    cached) is sent without SWA KV for it; the decode side's windowed layers never read it."""
    handle = make_handle("swa")
    not_resident: list[int] = []
    handle.pair.add_transfer_listener(record_checker(handle, not_resident))
    handle.reset(0, ())
    stem, ext = list(range(1, 31)), list(range(40, 60))  # ext is longer than the window (16)
    prompts = [stem, stem + ext, stem + ext + [7, 8]]
    outputs = handle.generate(prompts[:2], 4)
    prefill = handle.prefill.engine
    assert prefill.radix_cache.evict_swa(1) == len(stem), "the stem's node was not the one tombstoned"
    outputs += handle.generate(prompts[2:], 4)
    assert not_resident[-2:] == [0, len(stem)]
    assert outputs == make_engine("swa").generate(prompts, 4)
    assert handle.violations() == [] and handle.healthy()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("attention", ["mha", "swa"])
def test_pair_on_two_devices(attention):
    single = make_engine(attention, device="cuda:0")
    pair = PDPair(make_engine(attention, device="cuda:0"), make_engine(attention, device="cuda:1"))
    prompts = mixed_prompts(0, 8)
    assert pair.generate(prompts, 8) == single.generate(prompts, 8)


def test_a_pair_needs_one_model():
    with pytest.raises(ValueError, match="same model"):
        PDPair(make_engine("mha"), make_engine("mha", seed=1))

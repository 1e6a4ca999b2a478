"""A storage tier under the host tier: pages host memory evicts go to files on local disk (written,
synced, renamed: listed only once complete), keyed by the context and the token path, and come back
through host memory when a prompt needs them again, with the canary's records. The first forward
that reads them verifies them: a byte flipped on disk is reported there; a torn file, a failed
store, or a file of another context is refused at load and counted, and the pages are computed
anew. The reference engine is built with both tiers and guarded by hand here."""

import torch

from pytest_kvcanary.adapters.reference import make_reference_engine
from pytest_kvcanary.canary.runtime import CanaryRuntime
from pytest_kvcanary.config import CanaryConfig
from pytest_kvcanary.reference_engine import disk_tier
from pytest_kvcanary.reference_engine.disk_tier import DiskTier

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = "triton" if DEVICE == "cuda" else "torch"
FIRST = ["the first prompt, which goes to host memory, then to disk, and comes back"]
OTHERS = ["a second prompt, which pushes the first one out", "another one of those, just as long",
          "and a third one, so that the pool runs short", "and a fourth, so host memory runs short too"]


def engine_and_canary(tmp_path):
    """Pages of 16 tokens: a device pool of 9 pages, host memory of 6, a disk tier."""
    engine = make_reference_engine("mha", DEVICE, seed=0, page_size=16, num_slots=160, host_num_slots=96,
                                   disk_dir=str(tmp_path / "pages"))
    canary = CanaryRuntime(CanaryConfig(real_data="all", sweep_interval=2, kernels=KERNELS), engine)
    engine.set_forward_hooks(canary)
    return engine, canary


def to_disk(engine):
    """Generate the first prompt, push it to disk; the output and its node."""
    (before,) = engine.generate(FIRST, 8)
    for prompt in OTHERS:
        engine.generate([prompt], 8)
    (node,) = [n for n in engine.radix_cache.roots[0].children.values() if n.disk_keys is not None]
    return before, node


def test_pages_stored_to_disk_and_loaded_back_are_clean(tmp_path):
    engine, canary = engine_and_canary(tmp_path)
    before, node = to_disk(engine)
    assert all(engine.disk_tier.path(key).exists() for key in node.disk_keys)
    assert engine.generate(FIRST, 8) == [before]  # disk -> host -> device
    disk = engine.disk_tier
    assert disk.num_stored > 0 and disk.num_loaded > 0 and not disk.refused
    canary.drain()
    assert canary.log.violations == [] and canary.health_problems() == []


def test_a_byte_flipped_on_disk_is_reported_before_its_first_read(tmp_path):
    engine, canary = engine_and_canary(tmp_path)
    _, node = to_disk(engine)
    path = engine.disk_tier.path(node.disk_keys[0])
    data = bytearray(path.read_bytes())
    header = int.from_bytes(data[8:16], "little")  # magic, header size, header, payload size, payload
    row = engine.host_tier.pools[0].k_layers[0][0]  # the payload opens with layer 0's K, slot by slot
    data[16 + header + 8 + 3 * row.numel() * row.element_size()] ^= 1  # the 4th token's
    path.write_bytes(bytes(data))
    loading = canary.forwards
    engine.generate(FIRST, 8)
    canary.drain()
    first = canary.log.violations[0]
    assert (first.step, first.phase, first.group, first.reasons, first.position) == (
        loading, "HEAD", "FULL", ("verify_real_kv_hash",), 3)


def test_a_torn_file_is_refused_at_load(tmp_path):
    engine, canary = engine_and_canary(tmp_path)
    before, node = to_disk(engine)
    path = engine.disk_tier.path(node.disk_keys[0])
    path.write_bytes(path.read_bytes()[:1000])
    assert engine.generate(FIRST, 8) == [before]  # computed anew
    assert engine.disk_tier.refused == {"torn": 1}
    canary.drain()
    assert canary.log.violations == []


def test_a_store_that_fails_midway_is_never_visible(tmp_path, monkeypatch):
    def fail(f, data):
        f.write(data[:100])
        raise OSError("no space left on device")

    monkeypatch.setattr(DiskTier, "_write", staticmethod(fail))
    engine, canary = engine_and_canary(tmp_path)
    (before,) = engine.generate(FIRST, 8)
    for prompt in OTHERS:
        engine.generate([prompt], 8)
    disk = engine.disk_tier
    assert disk.num_failed_stores > 0 and not disk.index and not list(disk.dir.iterdir())
    assert engine.generate(FIRST, 8) == [before]
    canary.drain()
    assert canary.log.violations == []


def test_two_contexts_on_one_key_are_refused_at_load(tmp_path, monkeypatch):
    keyed = disk_tier.page_key
    monkeypatch.setattr(disk_tier, "page_key", lambda context, prefix: keyed(0, prefix))  # forgets the context
    engine, canary = engine_and_canary(tmp_path)
    before = engine.generate(FIRST * 2, 8, context_keys=[1, 2])
    for prompt in OTHERS:
        engine.generate([prompt], 8)
    after = [engine.generate(FIRST, 8, context_keys=[c])[0] for c in (1, 2)]
    assert after == before and engine.disk_tier.refused["another context"] >= 1
    canary.drain()
    assert canary.log.violations == []

"""The storage tier under the host tier: pages host memory evicts are stored as files (written,
synced, renamed: listed only when complete) and loaded back through host memory on a later hit,
with the canary's records; greedy outputs equal a no-cache recomputation with the canary clean.
Each storage fault is detected by the canary at the slot it lands in (a flipped byte) or refused
at load and counted (a torn file, a failed store left visible, two contexts on one key), the
request then computing the pages anew."""

from __future__ import annotations

import json
import random

import pytest
import torch

from pytest_kvcanary.canary.runtime import CanaryRuntime
from pytest_kvcanary.config import CanaryConfig
from pytest_kvcanary.reference_engine import EngineConfig, ModelConfig
from pytest_kvcanary.reference_engine import disk_tier as disk_module
from pytest_kvcanary.reference_engine.disk_tier import SUFFIX, DiskTier
from pytest_kvcanary.reference_engine.kv_pool import slot_pages
from pytest_kvcanary.reference_engine.radix_cache import CAUSE_STORED

KERNELS = "triton" if torch.cuda.is_available() else "torch"


def attach(engine, **settings) -> CanaryRuntime:
    runtime = CanaryRuntime(CanaryConfig(**{"real_data": "all", "sweep_interval": 2, "kernels": KERNELS,
                                            **settings}), engine)
    engine.set_forward_hooks(runtime)
    return runtime


def tiered(tmp_path, page_size: int = 4, disk_pages: int = 256) -> dict:
    """14 device pages of 4 tokens (page 0 reserved), 2 rows, 8 host pages, a disk tier."""
    return {"page_size": page_size, "num_slots": 15 * page_size, "max_running": 2, "host_num_slots": 8 * page_size,
            "disk_dir": str(tmp_path / "pages"), "disk_num_pages": disk_pages}


def nodes(engine):
    stack = [c for root in engine.radix_cache.roots.values() for c in root.children.values()]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def check_tiers(engine) -> None:
    """Down every path: device-resident, then host-resident, then disk-resident nodes; each off the
    device in exactly one of host memory or the disk; host pages held once; the index lists the
    disk-resident nodes' keys, which are the complete files on disk, no more than the tier holds."""
    tier, disk = engine.host_tier, engine.disk_tier
    held, keys = [], []
    for n in nodes(engine):
        if n.value is None:
            assert (n.host_value is None) != (n.disk_keys is None), "a node off the device in both or neither tier"
        else:
            assert n.disk_keys is None, "a device-resident node keeps disk files"
        below = [c for c in n.children.values()]
        if n.value is None:
            assert all(c.value is None for c in below), "a device-resident node below an evicted one"
        if n.disk_keys is not None:
            assert all(c.disk_keys is not None for c in below), "a host-resident node below a disk-resident one"
            assert len(n.disk_keys) * engine.config.page_size == len(n.key)
            keys += n.disk_keys
        if n.host_value is not None:
            held.append(slot_pages(n.host_value, tier.page_size))
    held = torch.cat(held + [torch.empty(0, dtype=torch.int64)])
    assert held.unique().numel() == held.numel() and held.numel() + tier.free_pages.numel() == tier.num_pages
    assert sorted(keys) == sorted(disk.index), "the index and the tree disagree"
    assert sorted(p.name for p in disk.dir.glob(f"*{SUFFIX}")) == sorted(k + SUFFIX for k in disk.index)
    assert len(disk.index) <= disk.num_pages


def prompts(seed: int, n: int, length: int = 20) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(length)] for _ in range(n)]


def push_to_disk(engine, first: list[int], context: int = 0, seed: int = 1):
    """Prompts of 5 pages until the first prompt's pages are all on disk; its top node."""
    for p in prompts(seed, 12):
        node = next(n for n in engine.radix_cache.root(context).children.values() if n.key[:4] == first[:4])
        if node.disk_keys is not None:
            return node
        engine.generate([p], 1)
    raise AssertionError("the first prompt never reached the disk")


@pytest.mark.parametrize(("attention", "k", "disk_pages"), [("mha", 0, 256), ("mha", 3, 256), ("mla", 0, 256),
                                                            ("mha", 0, 16)],
                         ids=["mha", "mha-speculative", "mla", "mha-small-disk"])
def test_greedy_outputs_equal_the_no_cache_recomputation_with_the_canary_clean(
        attention, k, disk_pages, tmp_path, make_engine, assert_reference):
    engine = make_engine(attention, speculative_k=k, **tiered(tmp_path, disk_pages=disk_pages))
    runtime = attach(engine)
    first = prompts(0, 3)
    before = engine.generate(first, 6)
    for p in prompts(1, 6):
        engine.generate([p], 6)
        check_tiers(engine)
    again = engine.generate(first, 6)
    check_tiers(engine)
    assert again == before
    assert_reference(engine, first, again)
    disk = engine.disk_tier
    assert disk.num_stored > 0 and not disk.refused and not disk.num_failed_stores
    assert disk.num_loaded > 0 if disk_pages > 16 else disk.num_stored > disk_pages  # a small disk drops pages
    runtime.drain()
    assert runtime.log.violations == [] and runtime.health_problems() == []
    engine.reset()
    assert not list(disk.dir.iterdir())


def test_host_memory_short_stores_pages_instead_of_dropping_them(tmp_path, make_engine):
    engine = make_engine("mha", **tiered(tmp_path))
    causes: list[str] = []
    engine.host_tier.add_listener(type("Frees", (), {
        "written_back": lambda self, kind, f, h: None, "loaded_back": lambda self, kind, h, f: None,
        "host_freed": lambda self, kind, h, cause: causes.append(cause)})())
    first = prompts(0, 1)[0]
    engine.generate([first], 1)
    node = push_to_disk(engine, first)
    assert node.value is None and node.host_value is None and CAUSE_STORED in causes
    (path,) = [engine.disk_tier.path(key) for key in node.disk_keys[:1]]
    assert path.exists() and not list(engine.disk_tier.dir.glob("*.tmp"))


def field_offset(data: bytes, section: str, row: int) -> int:
    """Where row `row` of a section of a page file begins."""
    size = int.from_bytes(data[8:16], "little")
    header = json.loads(data[16:16 + size])
    at = 16 + size + 8
    for name, dtype, shape in header["sections"]:
        item = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        row_bytes = item * (torch.Size(shape[1:]).numel() if len(shape) > 1 else 1)
        if name == section:
            return at + row * row_bytes
        at += row_bytes * shape[0]
    raise KeyError(section)


def test_a_byte_flipped_on_disk_is_reported_at_the_slot_it_lands_in_before_its_first_read(tmp_path, make_engine):
    engine = make_engine("mha", **tiered(tmp_path))
    runtime = attach(engine, sweep_interval=0)
    first = prompts(0, 1)[0]
    engine.generate([first], 1)  # 20 KV tokens: 5 pages cached
    node = push_to_disk(engine, first)
    path = engine.disk_tier.path(node.disk_keys[1])  # positions 4..7
    data = bytearray(path.read_bytes())
    data[field_offset(data, "kv.full.V2", 2) + 5] ^= 4  # position 6
    path.write_bytes(bytes(data))
    runtime.drain()
    assert runtime.log.violations == []
    req = engine.submit(first + [7], 2)
    engine.step()  # disk -> host -> device, then HEAD reads them
    slot = int(engine.req_to_token_pool.read(req.row, 6, 7)[0])
    runtime.drain()
    assert [(v.phase, v.half, v.reasons, v.slot, v.position, v.row) for v in runtime.log.violations] == [
        ("HEAD", "V", ("verify_real_kv_hash",), slot, 6, req.row)]
    assert engine.disk_tier.num_loaded == 5 and not engine.disk_tier.refused


@pytest.mark.parametrize("damage", ["truncated", "extended", "header"])
def test_a_torn_file_is_refused_at_load_and_the_pages_computed_anew(damage, tmp_path, make_engine, assert_reference):
    engine = make_engine("mha", **tiered(tmp_path))
    runtime = attach(engine)
    first = prompts(0, 1)[0]
    (before,) = engine.generate([first], 4)
    node = push_to_disk(engine, first)
    path = engine.disk_tier.path(node.disk_keys[2])
    data = path.read_bytes()
    path.write_bytes({"truncated": data[:len(data) // 2], "extended": data + b"\0",
                      "header": data[:20] + b"#" + data[21:]}[damage])
    (after,) = engine.generate([first], 4)
    assert after == before
    assert_reference(engine, [first], [after])
    assert engine.disk_tier.refused == {"torn": 1} and not path.exists()
    check_tiers(engine)
    runtime.drain()
    assert runtime.log.violations == []


def test_a_failed_store_is_never_listed(tmp_path, make_engine, monkeypatch):
    """A store that raises midway leaves its temporary file (a crash: nothing cleans up), which no
    lookup sees; the node leaves the tree as without a disk tier, and the prompt is computed anew."""
    def fail_midway(f, data):
        f.write(data[:len(data) // 2])
        raise OSError("disk full")

    monkeypatch.setattr(DiskTier, "_write", staticmethod(fail_midway))
    monkeypatch.setattr(DiskTier, "_discard", staticmethod(lambda path: None))
    engine = make_engine("mha", **tiered(tmp_path))
    runtime = attach(engine)
    first = prompts(0, 1)[0]
    (before,) = engine.generate([first], 4)
    for p in prompts(1, 6):
        engine.generate([p], 1)
    disk = engine.disk_tier
    assert disk.num_failed_stores > 0 and not disk.index and list(disk.dir.glob("*.tmp"))
    assert not list(disk.dir.glob(f"*{SUFFIX}"))
    check_tiers(engine)
    assert engine.generate([first], 4) == [before] and disk.num_loaded == 0
    runtime.drain()
    assert runtime.log.violations == []


def test_a_failed_store_left_visible_is_refused_at_load(tmp_path, make_engine, monkeypatch):
    """A short write that went unnoticed, renamed into place: the file is torn, refused at load."""
    monkeypatch.setattr(DiskTier, "_write", staticmethod(lambda f, data: f.write(data[:-100])))
    engine = make_engine("mha", **tiered(tmp_path))
    runtime = attach(engine)
    first = prompts(0, 1)[0]
    (before,) = engine.generate([first], 4)
    push_to_disk(engine, first)
    assert engine.generate([first], 4) == [before]
    assert engine.disk_tier.refused == {"torn": 1} and engine.disk_tier.num_loaded == 0
    runtime.drain()
    assert runtime.log.violations == []


def test_two_contexts_on_one_key_are_refused_at_load(tmp_path, make_engine, monkeypatch):
    """A key function that forgets the context: two contexts' pages of one prompt land in one file
    (the later store replaces it); the other context's load finds a header naming another context
    and refuses it."""
    keyed = disk_module.page_key
    monkeypatch.setattr(disk_module, "page_key", lambda context, prefix: keyed(0, prefix))
    engine = make_engine("mha", **tiered(tmp_path))
    runtime = attach(engine)
    first = prompts(0, 1)[0]
    before = engine.generate([first, first], 4, context_keys=[1, 2])
    for context in (1, 2):
        push_to_disk(engine, first, context, seed=context)
    after = [engine.generate([first], 4, context_keys=[context])[0] for context in (1, 2)]
    assert after == before and engine.disk_tier.refused["another context"] == 1
    runtime.drain()
    assert runtime.log.violations == []


def test_the_key_names_the_context_and_the_token_path():
    key = disk_module.page_key
    assert key(1, [5, 6, 7, 8]) != key(2, [5, 6, 7, 8])
    assert key(1, [5, 6, 7, 8]) != key(1, [4, 6, 7, 8]) and key(1, [5, 6]) == key(1, [5, 6])


def test_disk_tier_config_errors():
    with pytest.raises(ValueError, match=r"disk_dir needs a host tier \(host_num_slots > 0\) .*host_num_slots=0"):
        EngineConfig(disk_dir="/tmp/x")
    with pytest.raises(ValueError, match="disk_dir needs .*attention='hybrid'"):
        EngineConfig(model=ModelConfig(attention="hybrid"), host_num_slots=64, disk_dir="/tmp/x")
    with pytest.raises(ValueError, match="disk_dir must be a directory path .*; got ''"):
        EngineConfig(host_num_slots=64, disk_dir="")
    with pytest.raises(ValueError, match="disk_num_pages must be an integer >= 1; got 0"):
        EngineConfig(host_num_slots=64, disk_dir="/tmp/x", disk_num_pages=0)

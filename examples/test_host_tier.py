"""A host-memory tier behind the radix cache: pages it evicts are written back to host memory and
loaded back when a prompt needs them again. The canary's records travel with the bytes, so the
first forward that reads a loaded-back page verifies it: a byte that changed while the page was on
the host is reported there, before the forward reads it. The reference engine is built with a host
tier (and pages) and guarded by hand here."""

import torch

from pytest_kvcanary.adapters.reference import make_reference_engine
from pytest_kvcanary.canary.runtime import CanaryRuntime
from pytest_kvcanary.config import CanaryConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = "triton" if DEVICE == "cuda" else "torch"
FIRST = ["the first prompt, which goes to host memory and comes back", "its sibling, which travels along too"]
SECOND = ["a second prompt, which pushes the first ones out", "another one of those, just as long",
          "and a third one, so that the pool runs short"]


def engine_and_canary():
    """Pages of 16 tokens, a device pool of 9 pages and a host tier of 64."""
    engine = make_reference_engine("mha", DEVICE, seed=0, page_size=16, num_slots=160, host_num_slots=1024)
    canary = CanaryRuntime(CanaryConfig(real_data="all", sweep_interval=2, kernels=KERNELS), engine)
    engine.set_forward_hooks(canary)
    return engine, canary


def test_pages_written_back_and_loaded_back_are_clean():
    engine, canary = engine_and_canary()
    before = engine.generate(FIRST, 8)
    engine.generate(SECOND, 8)  # the first prompts' pages go to host memory
    assert engine.generate(FIRST, 8) == before  # ... and come back
    tier = engine.host_tier
    assert tier.num_written_back > 0 and tier.num_loaded_back > 0
    canary.drain()
    assert canary.log.violations == [] and canary.health_problems() == []


def test_a_byte_flipped_on_the_host_is_reported_before_its_first_read_after_the_load_back():
    engine, canary = engine_and_canary()
    engine.generate(FIRST, 8)
    engine.generate(SECOND, 8)
    node = next(n for n in engine.radix_cache.roots[0].children.values() if n.value is None)
    host_slot = int(node.host_value[3])  # the 4th token of a page now only in host memory
    engine.host_tier.pools[0].k_layers[0].view(torch.uint8)[host_slot, 0, 0] ^= 1
    canary.drain()
    assert canary.log.violations == []

    loading = canary.forwards  # the next forward loads the pages back, then reads them
    engine.generate(FIRST, 8)
    canary.drain()
    first = canary.log.violations[0]
    assert (first.step, first.phase, first.group, first.reasons, first.position) == (
        loading, "HEAD", "FULL", ("verify_real_kv_hash",), 3)
    assert {v.slot for v in canary.log.violations} == {first.slot}  # where the sweeps find it again

"""vLLM-shaped bugs put back into vLLM's own code with a monkeypatch: the canary catches each, and
the same workload runs clean on the unpatched code.

- A block hash that ignores the last token of each block: a prompt that differs from a cached one
  only there hits the cached block and reads KV computed for another token (prefix caching
  returning the wrong completion).
- A prefix-cache hit that takes no reference on a block another running request holds: when that
  request finishes, the block goes back to the pool while the hitting request still reads it, and
  the next allocation overwrites it (a use-after-free of KV).
"""

from __future__ import annotations

import random

import pytest

from .support import INSTALL, make_engine, make_handle

pytest.importorskip("vllm", reason=INSTALL)

from vllm import SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402


def hash_without_last_token(monkeypatch) -> None:
    hash_block_tokens = kv_cache_utils.hash_block_tokens

    def buggy(hash_function, parent_block_hash, curr_block_token_ids, extra_keys=None):
        return hash_block_tokens(hash_function, parent_block_hash, curr_block_token_ids[:-1], extra_keys)

    monkeypatch.setattr(kv_cache_utils, "hash_block_tokens", buggy)


def hit_without_reference(monkeypatch) -> None:
    touch = BlockPool.touch

    def buggy(self, blocks):
        touch(self, [b for b in blocks if b.ref_cnt == 0])  # a block in use gets no new reference

    monkeypatch.setattr(BlockPool, "touch", buggy)


def one_token_apart(engine, handle) -> None:
    """A prompt, then the same prompt with the last token of its first block changed."""
    rng = random.Random(0)
    first = [rng.randrange(256) for _ in range(80)]
    second = list(first)
    second[31] = (second[31] + 1) % 256
    handle.generate([first], 4)
    handle.generate([second], 4)


def sharer_outlives_owner(engine, handle) -> None:
    """An owner and a sharer of its first two blocks start together; the owner finishes at once,
    the sharer decodes on while more requests than fit wait for blocks."""
    rng = random.Random(0)
    owner = [rng.randrange(256) for _ in range(70)]
    sharer = owner[:64] + [rng.randrange(256) for _ in range(10)]
    fillers = [[rng.randrange(256) for _ in range(90)] for _ in range(10)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in [2, 40] + [6] * 10]
    engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in [owner, sharer] + fillers], params,
                        use_tqdm=False)


@pytest.mark.parametrize("bug,workload,reasons", [
    (hash_without_last_token, one_token_apart, {"verify_token"}),
    (hit_without_reference, sharer_outlives_owner, {"verify_real_kv_hash", "verify_chain_hash", "verify_token",
                                                    "verify_position"}),
])
@pytest.mark.parametrize("patched", [True, False], ids=["bug", "clean"])
def test_vllm_bug_is_caught_and_clean_code_is_not(monkeypatch, bug, workload, reasons, patched):
    engine = make_engine("mha", num_blocks=24)  # its own: a bug leaves vLLM's block pool inconsistent
    if patched:
        bug(monkeypatch)
    handle = make_handle(engine)
    workload(engine, handle)
    violations = handle.violations()
    if not patched:
        assert violations == []
        return
    assert violations, "the canary missed the bug"
    heads = [v for v in violations if v.phase == "HEAD"]
    assert heads and all(set(v.reasons) & reasons for v in heads), violations[:5]

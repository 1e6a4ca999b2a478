"""BlockBook: the scheduler-side account of what vLLM's KV blocks hold, kept by the canary's
connector.

vLLM's blocks carry a ref count and, once full, a chained content hash, but no tokens, positions
or parent. The book records them as each step is scheduled: for every scheduled request and KV
cache group, the positions this step computes, the tokens there and, per block written, the hash
key of the block before it. From that it plans the canary's view of the step (`plan`), walks the
prefix cache for the sweep (`walk`: the full-attention group's blocks; `window_pairs`: the
sliding-window block cached beside each), and tells free listeners when a block's data stops
being anyone's (a request finished or was preempted holding a block no hash keeps, a block was
handed out again, a block no hash keeps left a request's sliding window, the prefix cache was
reset).

With vLLM's hybrid KV cache manager (a model with sliding-window layers), full-attention and
sliding-window layers are KV cache groups of their own, each with its own block table over one
shared block pool (a block id belongs to one group at a time); the sliding-window group's manager
drops a request's blocks once they leave its window (their entries become the null block 0) and
tells no connector: the book hooks that drop (`bind`), through the engine's Patches
(../patches.py), which the engine undoes when it is closed.

Everything here runs between forwards on the scheduler side; vLLM calls the connector, the
connector calls the book.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch

from pytest_kvcanary.canary.seam import CacheWalk

from ..patches import Patches

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

NULL_BLOCK = 0  # vLLM's null block: never a request's; a sliding-window entry that left the window

# Called with (block ids, cause) before the blocks' data is declared gone.
BlocksFreed = Callable[[list[int], str], None]


class RowPlan(NamedTuple):
    """One scheduled request as the scheduler plans this step: the forward reads and writes what
    vLLM's model runner hands it (forward_inputs.py); the plan says what only the scheduler
    knows."""

    request_id: str  # vLLM's request id
    request: int  # the book's id of the request (admission order since the last reset)
    first: int  # positions [0, first) were computed before this step; [first, vLLM's computed
    # tokens) are computed in this step by another request that shares their blocks
    tokens: list[int]  # the scheduler's token at each position the forward reads or writes


class BlockContent(NamedTuple):
    group: int  # vLLM's KV cache group the block was written for
    index: int  # the block's index in the request that wrote it: positions index * block_size + j
    tokens: tuple[int, ...]  # tokens written so far
    parent: Any  # vLLM's hash key (BlockHashWithGroupId) of the block before it; None at index 0


@dataclass
class BlockBook:
    on_freed: BlocksFreed
    patches: Patches  # the engine's: where `bind` records its hooks on vLLM's managers
    manager: KVCacheManager | None = None  # bound once vLLM built its scheduler (`bind`)
    planned: int = 0  # steps planned that run a forward (the worker side must see each)
    prefix_hits: int = 0  # requests the scheduler found a cached prefix for (`matched`), since start-up
    _requests: dict[str, tuple[int, Request]] = field(default_factory=dict)  # vLLM id -> (book id, request)
    _prompts: list[list[int]] = field(default_factory=list)  # prompt token ids by book id
    _held: dict[str, list[int]] = field(default_factory=dict)  # blocks each request had when last scheduled
    # (every group, the null block left out)
    _contents: dict[int, BlockContent] = field(default_factory=dict)
    _released: set[int] = field(default_factory=set)  # blocks whose data listeners already heard is gone
    _window_groups: list[int] = field(default_factory=list)  # read from the manager's config at `bind`
    _state_groups: list[int] = field(default_factory=list)  # the same: groups of recurrent layers (states.py)
    _full_group: int = 0

    def bind(self, manager: KVCacheManager) -> None:
        """vLLM built its scheduler: keep its KV cache manager and hear its sliding-window managers
        drop blocks that left a request's window (vLLM frees them without telling a connector):
        each sliding-window manager's ``remove_skipped_blocks`` is wrapped through `patches`."""
        from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

        self.manager = manager
        specs = [group.kv_cache_spec for group in manager.kv_cache_config.kv_cache_groups]
        self._window_groups = [g for g, spec in enumerate(specs) if isinstance(spec, SlidingWindowSpec)]
        self._state_groups = [g for g, spec in enumerate(specs) if isinstance(spec, MambaSpec)]
        self._full_group = next(g for g in range(len(specs)) if g not in self._window_groups + self._state_groups)
        for group in self.window_groups:
            single = manager.coordinator.single_type_managers[group]

            def hear(remove: Any, _single: Any = single) -> Any:
                def dropping(request_id: str, *args: Any, **kwargs: Any) -> None:
                    before = list(_single.req_to_blocks.get(request_id, ()))
                    remove(request_id, *args, **kwargs)
                    after = _single.req_to_blocks.get(request_id, ())
                    dropped = [b for b, now in zip(before, after) if now is not b]
                    self._release([b.block_id for b in dropped if b.ref_cnt == 0 and b.block_hash is None],
                                  "left the sliding window")
                return dropping

            self.patches.wrap(single, "remove_skipped_blocks", hear)

    @property
    def full_group(self) -> int:
        """vLLM's KV cache group of the full-attention layers (the prefix cache's walk)."""
        assert self.manager is not None, "vLLM has not bound its KV cache manager to the connector yet"
        return self._full_group

    @property
    def window_groups(self) -> list[int]:
        """vLLM's KV cache groups of sliding-window layers (only with its hybrid KV cache manager)."""
        assert self.manager is not None, "vLLM has not bound its KV cache manager to the connector yet"
        return self._window_groups

    @property
    def state_groups(self) -> list[int]:
        """vLLM's KV cache groups of recurrent layers (a hybrid model's ``MambaSpec`` groups)."""
        assert self.manager is not None, "vLLM has not bound its KV cache manager to the connector yet"
        return self._state_groups

    @property
    def pool(self) -> BlockPool:
        assert self.manager is not None, "vLLM has not bound its KV cache manager to the connector yet"
        return self.manager.block_pool

    @property
    def block_size(self) -> int:
        assert self.manager is not None, "vLLM has not bound its KV cache manager to the connector yet"
        return self.manager.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size

    def matched(self, num_computed_tokens: int) -> None:
        """vLLM's scheduler found this many tokens of a waiting request in its prefix cache (it asks
        the connector for more right after: `get_num_new_matched_tokens`)."""
        self.prefix_hits += num_computed_tokens > 0

    def admit(self, request: Request) -> None:
        self._requests[request.request_id] = (len(self._prompts), request)
        self._prompts.append(list(request.prompt_token_ids or ()))

    def prompt(self, book_id: int) -> list[int]:
        """The prompt token ids of a request admitted since the last reset."""
        return self._prompts[book_id]

    def plan(self, step: SchedulerOutput) -> list[RowPlan]:
        """The canary's rows for this step, in scheduling order.

        A request can hit prefix blocks that another request of the same step computes (vLLM
        caches a block when it schedules its computation). The forward writes those blocks before
        attention reads them, but the canary cannot verify them before the forward: such a row's
        `first` stops before them (the engine counts them as computed by this row too; the
        records both rows stamp are the same: they chain content).
        """
        if step.scheduled_spec_decode_tokens or step.kv_cache_block_copies:
            raise NotImplementedError("the vLLM canary connector guards neither speculative decoding nor KV "
                                      "block copies (partial prefix hits)")
        self._drop(step.preempted_req_ids or (), "request preempted")
        computed = {r.req_id: r.num_computed_tokens for r in step.scheduled_new_reqs}
        cached = step.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        blocks = {rid: [list(ids) for ids in self.manager.get_block_ids(rid)] for rid in computed}
        kv = [g for g in range(len(self.manager.kv_cache_config.kv_cache_groups)) if g not in self._state_groups]
        writer: dict[int, str] = {}
        for rid, start in computed.items():
            for g in kv:  # a state block is one request's (vLLM defers a hit on a state another step computes)
                for i in self._indices(start, start + step.num_scheduled_tokens[rid]):
                    writer.setdefault(blocks[rid][g][i], rid)
        paired = self._paired(blocks.values(), set(writer))
        rows = []
        for rid, start in computed.items():
            end = start + step.num_scheduled_tokens[rid]
            held = set(self._held.get(rid, ()))
            self._reused([b for mine in blocks[rid] for b in (mine[i] for i in self._indices(start, end))
                          if b not in held])
            first = min(next((i * self.block_size for i in range(-(-start // self.block_size))
                              if writer.get(blocks[rid][g][i], rid) != rid), start) for g in kv)
            if first < start:
                first = self._window_mapped(blocks[rid], paired, first)
            book_id, request = self._requests[rid]
            tokens = list(request.all_token_ids[:end])
            for group, mine in enumerate(blocks[rid]):
                self._record(group, mine, tokens, first, end)
            self._held[rid] = [b for mine in blocks[rid] for b in mine if b != NULL_BLOCK]
            rows.append(RowPlan(rid, book_id, first, tokens))
        self.planned += bool(rows)
        return rows

    def finished(self, request: Request, block_ids: tuple[list[int], ...]) -> None:
        """vLLM is about to free a finished request's blocks (per KV cache group): those only it
        holds and no hash keeps in the prefix cache lose their data."""
        blocks = self.pool.blocks
        self._release([b for ids in block_ids for b in ids
                       if b != NULL_BLOCK and blocks[b].ref_cnt == 1 and blocks[b].block_hash is None],
                      "request finished")
        self._held.pop(request.request_id, None)
        self._requests.pop(request.request_id, None)

    def reset(self) -> None:
        """vLLM flushed its prefix cache (no request holds a block): every block's data is gone."""
        self._release(list(self._contents), "prefix cache reset")
        self._requests.clear()
        self._held.clear()
        self._contents.clear()
        self._released.clear()
        self._prompts.clear()

    def content(self, block_id: int) -> BlockContent | None:
        """What the book last saw written to a block (None: nothing since the last reset)."""
        return self._contents.get(block_id)

    def walk(self) -> CacheWalk | None:
        """Every position the prefix cache holds, as FULL slots; None without prefix caching. A
        cached block whose parent hash no cached block carries any more is left out: vLLM can
        never hit it again (a hit walks the hash chain from the first block)."""
        if not self.pool.enable_caching:
            return None
        bs, blocks, index = self.block_size, self.pool.blocks, self.pool.cached_block_hash_to_block
        cols: list[list[int]] = [[], [], [], [], []]  # slots, positions, prev slots, tokens, locked
        full = self.full_group
        for block_id, content in self._contents.items():
            block = blocks[block_id]
            if block.block_hash is None or content.group != full:
                continue
            prev = -1
            if content.index:
                parent = index.get_one_block(content.parent)
                if parent is None:
                    continue
                prev = parent.block_id * bs + bs - 1
            count = min(len(content.tokens), (block.block_hash_num_tokens or bs) - content.index * bs)
            if count <= 0:
                continue
            first, position = block_id * bs, content.index * bs
            cols[0] += range(first, first + count)
            cols[1] += range(position, position + count)
            cols[2].append(prev)
            cols[2] += range(first, first + count - 1)
            cols[3] += content.tokens[:count]
            cols[4] += [block.ref_cnt > 0] * count
        slots, positions, prev_slots, tokens = (torch.tensor(c, dtype=torch.int64) for c in cols[:4])
        return CacheWalk(slots, positions, prev_slots, tokens, torch.tensor(cols[4], dtype=torch.bool))

    def window_pairs(self) -> list[tuple[int, int]]:
        """(full-attention block, sliding-window block) for every full-attention block the prefix
        cache holds whose sliding-window block of the same hash it holds too, held by no request:
        the pair a prefix hit on that hash hands a request. (vLLM caches a block when it schedules
        its computation: a held sliding-window block may not hold its data yet; the rows that hold
        it map it.) Empty without a sliding-window group or prefix caching."""
        from vllm.v1.core.kv_cache_utils import get_block_hash, make_block_hash_with_group_id

        windows = self.window_groups
        if not windows or not self.pool.enable_caching:
            return []
        blocks, index, full = self.pool.blocks, self.pool.cached_block_hash_to_block, self.full_group
        pairs = []
        for block_id, content in self._contents.items():
            key = blocks[block_id].block_hash
            if key is None or content.group != full:
                continue
            twin = index.get_one_block(make_block_hash_with_group_id(get_block_hash(key), windows[0]))
            if twin is not None and twin.ref_cnt == 0:
                pairs.append((block_id, twin.block_id))
        return pairs

    def _paired(self, blocks: Any, writing: set[int]) -> set[int]:
        """The full-attention blocks the canary's SWA mapping sends to a sliding-window block this
        step's forward does not write (engine.py: a scheduled request's sliding-window block at the
        same index, or the prefix cache's twin): what a row can read there before the forward."""
        windows = self.window_groups
        if not windows:
            return set()
        full = self.full_group
        paired = {f for ids in blocks for f, w in zip(ids[full], ids[windows[0]])
                  if w != NULL_BLOCK and w not in writing}
        return paired | {f for f, _ in self.window_pairs()}

    def _window_mapped(self, blocks: list[list[int]], paired: set[int], first: int) -> int:
        """`first`, or 0 where the sliding window a row reads before `first` has a block the
        canary's SWA mapping cannot reach before the forward: a row hitting blocks another row of
        the step computes reads from `first` on, and a prefix hit keeps only the sliding-window
        blocks before the hit's end (the others are the null block). From 0 the row reads nothing
        before the forward and counts its whole prefix as written (the same content another row
        writes or wrote; engine.py stamps its positions no sliding-window block holds for it
        elsewhere, so that its chain stays whole)."""
        for group in self.window_groups:
            window = self.manager.coordinator.single_type_managers[group].sliding_window - 1
            if any(blocks[self.full_group][i] not in paired for i in self._indices(max(0, first - window), first)):
                return 0
        return first

    def _indices(self, start: int, end: int) -> range:
        """Indices of the blocks holding positions [start, end)."""
        return range(start // self.block_size, -(-end // self.block_size))

    def _record(self, group: int, mine: list[int], tokens: list[int], start: int, end: int) -> None:
        bs = self.block_size
        for i in self._indices(start, end):
            if mine[i] == NULL_BLOCK:  # a sliding-window block a prefix hit left out, a state column skipped
                continue
            parent = self.pool.blocks[mine[i - 1]].block_hash if i else None
            self._contents[mine[i]] = BlockContent(group, i, tuple(tokens[i * bs:min(end, (i + 1) * bs)]), parent)
            self._released.discard(mine[i])

    def _reused(self, fresh: list[int]) -> None:
        """Blocks vLLM just handed to a request: what they held before is gone."""
        self._release([b for b in fresh if b in self._contents], "block reallocated")

    def _drop(self, request_ids: Any, cause: str) -> None:
        """Requests that gave their blocks back without finishing: blocks no hash keeps are gone."""
        blocks = self.pool.blocks
        for rid in request_ids:
            self._release([b for b in self._held.pop(rid, ()) if blocks[b].block_hash is None], cause)

    def _release(self, block_ids: list[int], cause: str) -> None:
        gone = [b for b in block_ids if b not in self._released]
        if gone:
            self._released.update(gone)
            self.on_freed(gone, cause)

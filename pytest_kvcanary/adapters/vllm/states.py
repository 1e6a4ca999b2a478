"""A hybrid model's recurrent state under vLLM (a model with ``MambaSpec`` KV cache groups, such as
Qwen3-Next's gated delta net layers): the canary's STATE group over one of those groups.

vLLM keeps a recurrent layer's state in blocks of the shared block pool, one block a state, each
layer's conv and SSM state tensors ``[num_blocks, ...]`` (the same memory as an attention layer's
pages). With prefix caching vLLM runs its ``align`` mamba cache mode: a request's mamba block table
is indexed by position like an attention one, the running state lives in the block of the column
holding the request's last computed token, ``(seq_len - 1) // block_size``, and vLLM splits
prefills so a state lands at every block boundary the prefix cache can use. When the running state
moves to a later column, vLLM's model runner copies the block of the previous column into the new
one before the forward (``mamba_utils.preprocess_mamba``); the block left behind keeps the state
after its column's last token: the prefix cache's checkpoint, cached under the full block's hash.
A prefix hit hands the request that cached block at the hit's last column, and the first forward
copies it into the request's own block (a restore). A row without a computed token starts from the
all-zero state without reading its block: vLLM hands mamba blocks out without zeroing them (it
zeroes attention blocks only) and tells its GDN forward that the row has no initial state, which
then zeroes the row's SSM state and ignores its conv state. The adapter clears such a row's block
before the forward instead (bytes the forward does not read), so that it holds the initial state,
the bytes of the null block 0, as HEAD expects.

So a state slot is a block id of the guarded mamba group (slot 0: the null block, the initial
state); a forward's `StateInputs.slots` are its GDN metadata's ``non_spec_state_indices_tensor``
(the block each row's state layers read and write; no checkpoint slots: vLLM's checkpoints are
the blocks left behind); the copies are heard where vLLM makes them (``collect_mamba_copy_meta``,
patched through the engine's Patches) and announced as ``states_copied`` before the next HEAD,
with the clears, copies of slot 0; the checkpoint walk lists the guarded group's cached
blocks, each at its block hash's length, chained through the full-attention block cached under the
same hash. vLLM keeps one mamba group per recurrent layer when a model has more recurrent than
attention layers (each with block ids of its own): only the first is guarded then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pytest_kvcanary.canary.seam import CheckpointWalk, ForwardHooks, GroupKind, PoolGroup, StateInputs

from ..patches import Patches

if TYPE_CHECKING:
    from .blocks import BlockBook


class States:
    """The STATE group over vLLM's mamba group `group` (its layers `names` in vLLM's static forward
    context `layers`), and what moves its states between forwards: the mamba state copies vLLM's
    model runner makes for `kv_cache_config` (its own; another engine's are not this one's), heard
    through `patches`."""

    def __init__(self, layers: dict[str, Any], names: list[str], group: int, kv_cache_config: Any,
                 patches: Patches, device: torch.device) -> None:
        from vllm.v1.worker import mamba_utils

        self.group_id, self.device, self._config = group, device, kv_cache_config
        buffers = []
        for name in names:
            conv, ssm = layers[name].kv_cache
            buffers += [conv, ssm.flatten(2)]  # a head's matrix one run, so a partial fingerprint samples each head
        self.group = PoolGroup(GroupKind.STATE, buffers, [], buffers[0].shape[0], None)
        self._layer = names[0]
        self._moves: list[tuple[torch.Tensor, torch.Tensor]] = []  # (src, dst) blocks, in the order made
        patches.wrap(mamba_utils, "collect_mamba_copy_meta", self._hear_copy)

    def _hear_copy(self, collect: Any) -> Any:
        def collecting(*args: Any, **kwargs: Any) -> None:
            collect(*args, **kwargs)
            bound = dict(zip(("copy_bufs", "kv_cache_config", "mamba_state_copy_funcs", "mamba_group_ids",
                              "src_block_idx", "dest_block_idx", "accept_token_bias", "req_state"), args), **kwargs)
            src, dst = bound["src_block_idx"], bound["dest_block_idx"]
            if src != dst and bound["kv_cache_config"] is self._config:
                ids = bound["req_state"].block_ids[self.group_id]
                self._moves.append((torch.tensor([ids[src]]), torch.tensor([ids[dst]])))
        return collecting

    def inputs(self, rows: int) -> StateInputs:
        """The forward now starting's state slots (inside vLLM's forward context): per row, the
        block its recurrent layers read and write; the blocks of rows vLLM starts from no state are
        cleared (see above)."""
        from vllm.forward_context import get_forward_context

        metadata = get_forward_context().attn_metadata[self._layer]
        if metadata.spec_state_indices_tensor is not None:
            raise NotImplementedError("the vLLM canary guards no speculative decoding of a hybrid model")
        slots = metadata.non_spec_state_indices_tensor[:rows].to(self.device, torch.int64)
        if metadata.has_initial_state is not None:  # None: every row decodes from its state
            fresh = slots[~metadata.has_initial_state[:rows].to(self.device)]
            if fresh.numel():
                for buffer in self.group.k_layers:
                    buffer[fresh] = 0
                self._moves.append((torch.zeros_like(fresh), fresh))
        zeros = torch.zeros_like(slots)
        return StateInputs(slots, zeros, zeros.clone())

    def announce(self, hooks: ForwardHooks | None) -> None:
        """Tell the canary the state copies made since the last forward (clears: copies of slot 0),
        in the order they were made."""
        moves, self._moves = self._moves, []
        if hooks is None:
            return
        for src, dst in moves:
            hooks.states_copied(src.to(self.device), dst.to(self.device))

    def walk(self, book: BlockBook, full_group: int, block_size: int) -> CheckpointWalk | None:
        """Every block of the guarded group the prefix cache holds (and the book saw written) whose
        full-attention block of the same hash it holds too, at its hash's length; None without
        prefix caching."""
        from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id, make_block_hash_with_group_id

        pool = book.pool
        if not pool.enable_caching:
            return None
        cols: list[list[int]] = [[], [], [], []]  # slots, lengths, prev slots, locked
        for block in pool.blocks:
            key = block.block_hash
            content = book.content(block.block_id)
            if key is None or get_group_id(key) != self.group_id or content is None:
                continue
            twin = pool.cached_block_hash_to_block.get_one_block(
                make_block_hash_with_group_id(get_block_hash(key), full_group))
            if twin is None:
                continue
            length = block.block_hash_num_tokens or (content.index + 1) * block_size
            cols[0].append(block.block_id)
            cols[1].append(length)
            cols[2].append(twin.block_id * block_size + (length - 1) % block_size)
            cols[3].append(int(block.ref_cnt > 0))
        slots, lengths, prev = (torch.tensor(c, dtype=torch.int64) for c in cols[:3])
        return CheckpointWalk(slots, lengths, prev, torch.tensor(cols[3], dtype=torch.bool), torch.zeros_like(slots))

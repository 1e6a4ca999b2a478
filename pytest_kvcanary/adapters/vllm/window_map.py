"""WindowMap: the SWA pool group's full-to-window slot map. Under vLLM's hybrid KV cache manager the
sliding-window layers are a KV cache group of their own, whose blocks the full-attention group's
block table does not name: the canary maps each full-attention slot to the sliding-window slot of
the same position, refilled before every forward and walk from the (full, window) block pairs the
prefix cache keeps and the ones the forward reads. Without it sliding-window layers use the
full-attention slots themselves (the identity)."""

from __future__ import annotations

import torch

from pytest_kvcanary.canary.seam import ForwardView

from . import forward_inputs


def last_pair_per_block(pairs: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """(full, window) block pairs [N, 2], in order, keeping for each full-attention block only the
    last pair that names it: an index_put_ with repeated indices leaves which value lands
    undefined on CUDA (the CPU's happens to be the last)."""
    order = torch.arange(pairs.shape[0], device=pairs.device)
    last = torch.full((num_blocks,), -1, dtype=torch.int64, device=pairs.device)
    last.scatter_reduce_(0, pairs[:, 0], order, reduce="amax")
    return pairs[last[pairs[:, 0]] == order]


class WindowMap:
    """``slots`` [num_slots]: full-attention slot -> sliding-window slot (zeros until refilled with
    the hybrid manager, else the identity); ``pairs``: the last forward's rows' (full, window)
    blocks."""

    def __init__(self, num_slots: int, block_size: int, device: torch.device, hybrid: bool) -> None:
        self.block_size = block_size
        self.slots = (torch.zeros(num_slots, dtype=torch.int64, device=device) if hybrid
                      else torch.arange(num_slots, device=device))
        self.pairs = torch.zeros(0, 2, dtype=torch.int64, device=device)

    def pair(self, inputs: forward_inputs.ForwardInputs, view: ForwardView, full_group: int, window_group: int,
             window: int, cached: list[tuple[int, int]]) -> None:
        """The forward's (full, window) block pairs, per row from the block holding the first position
        its sliding window reads on (the view's prefix length minus the window): vLLM drops the
        blocks before it on its scheduler side only, its model runner's block table keeps their
        old ids (never read again, possibly another request's by now). Then refill the map
        (`cached`: the prefix cache's pairs)."""
        bs, prefix_lens = self.block_size, view.prefix_lens
        full = inputs.block_tables[full_group].to(torch.int64)
        twin = inputs.block_tables[window_group].to(torch.int64)
        width = min(full.shape[1], twin.shape[1])
        index = torch.arange(width, device=full.device)
        # Entries past a row's last block are never read: they may still name a block of the
        # request that held the row before (vLLM 0.26's persistent batch keeps them).
        ends = -(-(prefix_lens + view.extend_lens) // bs)
        live = (index >= ((prefix_lens - window).clamp(min=0) // bs)[:, None]) & (index < ends[:, None])
        pairs = torch.stack([full[:, :width], twin[:, :width]], dim=-1)
        own = pairs[live]
        own = own[(own[:, 0] != 0) & (own[:, 1] != 0)]
        # A row that counts positions as written although no sliding-window block of its own holds
        # them (blocks.py, `first`: a hit on blocks another row computes this step) has them
        # stamped at the full-attention block's own slots, so that the chain it stamps on stays
        # whole: no sliding-window block table names a block the full-attention group holds, so
        # the SWA records there are nobody else's (until the map moves, at the next forward).
        mapped = set(own[:, 0].tolist()) | {f for f, _ in cached}
        unmapped = sorted({f for b, (start, end) in enumerate(zip((prefix_lens // bs).tolist(), ends.tolist()))
                           for f in full[b, start:min(end, width)].tolist() if f != 0 and f not in mapped})
        unmapped_pairs = torch.tensor(unmapped, dtype=torch.int64, device=own.device)[:, None].expand(-1, 2)
        self.pairs = torch.cat([own, unmapped_pairs])
        self.refill(cached)

    def refill(self, cached: list[tuple[int, int]]) -> None:
        """Refill the map: the prefix cache's (full, window) block pairs, then the last forward's
        rows' pairs (which the forward reads; they win where both name a full-attention block)."""
        bs, device = self.block_size, self.slots.device
        pairs = torch.cat([torch.tensor(cached, dtype=torch.int64, device=device).reshape(-1, 2), self.pairs])
        pairs = last_pair_per_block(pairs, self.slots.numel() // bs)
        offsets = torch.arange(bs, device=device)
        self.slots.zero_()
        self.slots[(pairs[:, :1] * bs + offsets).flatten()] = (pairs[:, 1:] * bs + offsets).flatten()

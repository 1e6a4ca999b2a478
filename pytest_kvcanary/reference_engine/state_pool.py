"""A hybrid model's state pool: one slot per running request or cached checkpoint.

A slot holds one sequence's recurrent state in every recurrent layer: ``conv[i][slot]`` (the
convolution's last inputs, ``[conv_width - 1, channels]``) and ``ssm[i][slot]`` (the matrix state,
``[state_heads, state_dim, state_dim]``), float32. Slot 0 is reserved: it holds the initial
(all-zero) state, which `clear` copies. Slots handed out and taken back are CPU int64; the
buffers live on the engine's device.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvcanary_kernels.records import GroupKind
from pytest_kvcanary.canary.seam import FreeListener

from .config import ModelConfig

# Told (src, dst) slots, on the engine's device, once their states are copied (the canary's
# records follow the bytes).
CopyListener = Callable[[torch.Tensor, torch.Tensor], None]


class StatePool:
    """Per recurrent layer, a conv and an ssm buffer; a free list of slots (slot 0 reserved).
    free_listeners hear every free (group STATE, the slots, the cause) before it; on_copy hears
    every copy once launched."""

    def __init__(self, num_slots: int, model: ModelConfig, device: torch.device,
                 free_listeners: list[FreeListener]) -> None:
        layers = [i for i, g in enumerate(model.layer_groups) if g is GroupKind.STATE]
        self.num_slots = num_slots
        self._index = {layer: j for j, layer in enumerate(layers)}
        w, c, h, n = model.conv_width, model.conv_channels, model.state_heads, model.state_dim
        self.conv = [torch.zeros(num_slots, w - 1, c, device=device) for _ in layers]
        self.ssm = [torch.zeros(num_slots, h, n, n, device=device) for _ in layers]
        # Each ssm buffer as [num_slots, heads, state_dim ** 2]: one run of bytes per head, so a
        # partial fingerprint samples each head (the canary reads buffers by their last dimension).
        self._buffers = [b for pair in zip(self.conv, (s.flatten(2) for s in self.ssm)) for b in pair]
        self.free_slots = list(range(1, num_slots))
        self._is_free = [False] + [True] * (num_slots - 1)
        self.free_listeners = free_listeners
        self.on_copy: CopyListener | None = None
        # Called before a copy writes a slot: a host tier's copies of freed slots, and its loads
        # back, land first (the engine sets it to the tier's wait).
        self.before_copy: Callable[[], None] | None = None

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Every buffer, layer by layer (conv, then ssm with a head's matrix flattened), the same
        objects for the pool's life: what the canary guards."""
        return self._buffers

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv and ssm buffers of model layer `layer` (a recurrent one)."""
        j = self._index[layer]
        return self.conv[j], self.ssm[j]

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def alloc(self, n: int) -> list[int] | None:
        """n free slots, or None (nothing allocated) when fewer are free."""
        if n > len(self.free_slots):
            return None
        slots, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        for slot in slots:
            self._is_free[slot] = False
        return slots

    def free(self, slots: list[int], cause: str) -> None:
        """Return allocated slots; freeing slot 0, a free slot or a slot twice is a bug."""
        if not slots:
            return
        assert len(set(slots)) == len(slots) and min(slots) > 0, "bad free"
        assert not any(self._is_free[s] for s in slots), "bad free"
        for listener in self.free_listeners:
            listener(GroupKind.STATE, torch.tensor(slots, dtype=torch.int64), cause)
        for slot in slots:
            self._is_free[slot] = True
        self.free_slots.extend(slots)

    def copy(self, src: list[int], dst: list[int]) -> None:
        """dst's states become src's (slot 0 as src: the initial state), in every layer."""
        if self.before_copy is not None:
            self.before_copy()
        device = self.conv[0].device if self.conv else torch.device("cpu")
        s, d = torch.tensor(src, dtype=torch.int64, device=device), torch.tensor(dst, dtype=torch.int64, device=device)
        for buf in self.buffers:
            buf[d] = buf[s]
        if self.on_copy is not None:
            self.on_copy(s, d)

    def clear(self, slots: list[int]) -> None:
        """These slots hold the initial state again (a request that starts from nothing)."""
        self.copy([0] * len(slots), slots)

    def restart(self) -> None:
        """With every slot free, hand them out from slot 1 up again, as a new pool does."""
        assert len(self.free_slots) == self.num_slots - 1, "restart while slots are held"
        self.free_slots.sort()

"""What the host uploads to the device per forward, in one copy from one pinned buffer: the batch
size, the token-table entries the forward adds (row, position, token) and, only when one changed,
the block-table rows. Token entries are fixed-size (max_tokens): unused ones go to a scratch row
past the view's rows, so applying them is one fixed-shape scatter (capturable in a CUDA graph). A
forward that adds more (a request starting on a cached prefix adds its whole sequence) has the rest
applied at upload, eagerly. The host side is one pinned buffer the copy reads asynchronously: a
forward's fill waits for the previous forward's copy (``wait_for_upload``), which matters where the
host runs a forward ahead of the device (async batching)."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch

from kvcanary_kernels.records import UNKNOWN, GroupKind

from ...canary.host import Capacities


class BatchBuffers:
    """batch ``[1]``, tables[kind] ``[max_batch, width]``, token_table ``[max_batch, max_context]``
    (device); per forward: ``wait_for_upload``, fill the host side (``set_batch``, ``set_row``,
    ``set_entries``), then ``upload`` and, on the device, ``apply_tokens``."""

    def __init__(self, capacities: Capacities, widths: Mapping[GroupKind, int], device: torch.device) -> None:
        b, t = capacities.max_batch, capacities.max_tokens
        always = {"batch": (1, 1), "tokens": (3, t)}  # uploaded every forward
        shapes = {**always, **{kind: (b, w) for kind, w in widths.items()}}  # tables: when a row changed
        total = sum(rows * cols for rows, cols in shapes.values())
        self._always = sum(rows * cols for rows, cols in always.values())
        self.device_flat = torch.zeros(total, dtype=torch.int64, device=device)
        self.staging = torch.zeros(total, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._copies = {False: (self.device_flat[:self._always], self.staging[:self._always]),
                        True: (self.device_flat, self.staging)}  # tables changed -> (destination, source)
        host_flat = self.staging.numpy()
        self.device_views: dict[object, torch.Tensor] = {}
        self.host: dict[object, np.ndarray] = {}
        start = 0
        for name, (rows, cols) in shapes.items():
            self.device_views[name] = self.device_flat[start:start + rows * cols].view(rows, cols)
            self.host[name] = host_flat[start:start + rows * cols].reshape(rows, cols)
            start += rows * cols
        self.scratch_row = b
        self.host["tokens"][0] = b  # every entry unused: the scratch row
        self._table = torch.full((b + 1, capacities.max_context), UNKNOWN, dtype=torch.int64, device=device)
        self.token_table = self._table[:b]
        self.batch = self.device_views["batch"][0]
        self.tables = {kind: self.device_views[kind] for kind in widths}
        self._tables_changed = True  # the first upload sends every table
        self._entries = 0  # token entries filled last forward
        self._spill: list[Sequence[int]] = [[], [], []]  # this forward's entries past max_tokens
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None  # the last copy's end

    def wait_for_upload(self) -> None:
        """Block until the last upload's copy has read the host side (CUDA; returns at once when
        the device has caught up, as it has whenever the engine synchronised since)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def set_batch(self, size: int) -> None:
        """The number of requests in this forward (rows at or past it are padding)."""
        self.host["batch"][0, 0] = size

    def set_row(self, kind: GroupKind, row: int, blocks: Sequence[int]) -> None:
        """Row `row` of the group's block table now holds `blocks` (the rest of the row: 0)."""
        host = self.host[kind]
        host[row, :len(blocks)] = blocks
        host[row, len(blocks):] = 0
        self._tables_changed = True

    def set_entries(self, rows: Sequence[int], positions: Sequence[int], tokens: Sequence[int]) -> None:
        """This forward's new token-table entries."""
        entries = self.host["tokens"]
        m = min(len(rows), entries.shape[1])
        entries[:, :m] = (rows[:m], positions[:m], tokens[:m])
        entries[0, m:self._entries] = self.scratch_row
        self._entries = m
        self._spill = [rows[m:], positions[m:], tokens[m:]]

    def upload(self) -> None:
        """Copy the host side over (the tables only when a row changed); write the token entries
        past the fixed-size part."""
        destination, source = self._copies[self._tables_changed]
        destination.copy_(source, non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()
        self._tables_changed = False
        if self._spill[0]:
            rows, positions, tokens = torch.tensor(self._spill, dtype=torch.int64).to(self._table.device)
            self._table.index_put_((rows, positions), tokens)

    def apply_tokens(self) -> None:
        """token_table[row, position] = token for this forward's entries (device work only)."""
        rows, positions, tokens = self.device_views["tokens"]
        self._table.index_put_((rows, positions), tokens)

    def reset(self) -> None:
        self._table.fill_(UNKNOWN)

"""The per-forward mapping the transformers adapter hands the canary, uploaded in one copy: the
batch's prefix and extend lengths, each group's block-table rows and the token-table entries the
forward adds (row, position, token), all views of one device buffer filled from one pinned host
buffer. Token entries are fixed-size (max_tokens): unused ones go to a scratch row past the
view's rows, so applying them is one fixed-shape scatter (capturable in a CUDA graph). A forward
that adds more (a request starting on a cached prefix adds its whole sequence) has the rest
applied at upload, eagerly."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch

from kvcanary_kernels.records import UNKNOWN, GroupKind

from ...canary.host import Capacities


class BatchBuffers:
    """lens ``[2, max_batch]``, tables[kind] ``[max_batch, width]``, token_table ``[max_batch,
    max_context]`` (device); fill the host side, then ``upload`` and ``apply_tokens``."""

    def __init__(self, capacities: Capacities, widths: Mapping[GroupKind, int], device: torch.device) -> None:
        b, t = capacities.max_batch, capacities.max_tokens
        shapes = {"lens": (2, b), **{kind: (b, w) for kind, w in widths.items()}, "tokens": (3, t)}
        total = sum(rows * cols for rows, cols in shapes.values())
        self.device_flat = torch.zeros(total, dtype=torch.int64, device=device)
        self.staging = torch.zeros(total, dtype=torch.int64, pin_memory=device.type == "cuda")
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
        self.lens = self.device_views["lens"]
        self.tables = {kind: self.device_views[kind] for kind in widths}
        self._batch = 0  # rows filled last forward
        self._entries = 0  # token entries filled last forward
        self._spill: list[Sequence[int]] = [[], [], []]  # this forward's entries past max_tokens

    def fill(self, prefix: Sequence[int], extend: Sequence[int], tables: Mapping[GroupKind, dict[int, list[int]]],
             rows: Sequence[int], positions: Sequence[int], tokens: Sequence[int]) -> None:
        """This forward's lengths (one per batch row), the table rows that changed (row -> block
        ids; rows from len(prefix) on are cleared) and its new token entries."""
        n, lens = len(prefix), self.host["lens"]
        lens[0, :n], lens[1, :n] = prefix, extend
        lens[:, n:self._batch] = 0
        for kind, changed in tables.items():
            host = self.host[kind]
            for row, blocks in changed.items():
                host[row, :len(blocks)] = blocks
                host[row, len(blocks):] = 0
            host[n:self._batch] = 0
        self._batch = n
        entries = self.host["tokens"]
        m = min(len(rows), entries.shape[1])
        entries[0, :m], entries[1, :m], entries[2, :m] = rows[:m], positions[:m], tokens[:m]
        entries[0, m:self._entries] = self.scratch_row
        self._entries = m
        self._spill = [rows[m:], positions[m:], tokens[m:]]

    def upload(self) -> None:
        """Copy the host side over; write the token entries past the fixed-size part."""
        self.device_flat.copy_(self.staging, non_blocking=True)
        if self._spill[0]:
            rows, positions, tokens = torch.tensor(self._spill, dtype=torch.int64).to(self._table.device)
            self._table.index_put_((rows, positions), tokens)

    def apply_tokens(self) -> None:
        """token_table[row, position] = token for this forward's entries (device work only)."""
        rows, positions, tokens = self.device_views["tokens"]
        self._table.index_put_((rows, positions), tokens)

    def reset(self) -> None:
        self._table.fill_(UNKNOWN)

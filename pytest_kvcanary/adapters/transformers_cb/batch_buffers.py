"""What the host hands the device per forward, through one pinned staging buffer per IO pair: the
batch size and how many tokens the forward samples, each batch row's lane (the mapping row its
request holds) and the token-table entries the forward adds (lane, position, token). The host only
fills the staging buffer; the copy to the device is the first device work of the canary inside the
forward (``upload``), so under CUDA graphs it is a copy node of the captured forward and a replay
reads the buffer as the host left it: a decode step launches no copy for it. The tokens the forward
samples go into the token table on the device (``put_tokens``), at the position each request decodes
next.

Token entries are fixed-size (max_tokens): unused ones go to a scratch row past the view's rows,
so applying them is one fixed-shape scatter. The host hands them over as runs (a lane, its first
position, the tokens from there on), so a run costs the host a few numpy operations and the tokens
one copy, whatever its length (a prompt's tokens are int64 already: prompt_arrays.py). A forward
that adds more (a request starting on a cached prefix adds its whole sequence) has the rest written
before the forward, as are the rows of lanes handed to another request, set to UNKNOWN
(``write_direct``). With async batching the host fills one pair's buffer while the device may still
run the other pair's forward. A pair's buffer is refilled only once the forward that last read it
is over, which the engine's loop guarantees without a wait: it refills a buffer only after
update_batch has read that forward's tokens (synchronous batching: the forward just before; async
batching: the forward before that, the last one of the same pair)."""

from __future__ import annotations

from importlib import import_module
from typing import Sequence

import numpy as np
import torch

from ...canary.seam import UNKNOWN, Capacities


class BatchBuffers:
    """batch ``[1]``, sampled ``[1]``, lanes ``[max_batch]``, token_table ``[lanes, max_context]``
    (device); per forward: ``select`` the pair, fill its staging buffer (``set_batch``,
    ``set_lanes``, ``clear_lanes``, ``set_entries``) and, when it ``has_direct_writes``, ``write_direct``
    (eager, before the forward); then, in the forward,
    ``upload`` and ``apply_tokens``, and once it sampled, ``put_tokens``."""

    def __init__(self, capacities: Capacities, lanes: int, device: torch.device, pairs: int,
                 fused: bool = False) -> None:
        """fused: apply_tokens by a Triton kernel that reads only the entries staged (view_kernels.py;
        CUDA, or the Triton interpreter), else by one scatter of every entry."""
        b, t = capacities.max_batch, capacities.max_tokens
        shapes = {"batch": (1, 3), "lanes": (1, b), "tokens": (3, t)}  # batch: size, sampled, entries staged
        total = sum(rows * cols for rows, cols in shapes.values())
        cuda = device.type == "cuda"
        self.device_flat = torch.zeros(total, dtype=torch.int64, device=device)
        self.staging = [torch.zeros(total, dtype=torch.int64, pin_memory=cuda) for _ in range(pairs)]
        self.device_views: dict[str, torch.Tensor] = {}
        self._hosts: list[dict[str, np.ndarray]] = [{} for _ in range(pairs)]
        start = 0
        for name, (rows, cols) in shapes.items():
            self.device_views[name] = self.device_flat[start:start + rows * cols].view(rows, cols)
            for host, staging in zip(self._hosts, self.staging):
                host[name] = staging.numpy()[start:start + rows * cols].reshape(rows, cols)
            start += rows * cols
        self.scratch_row = lanes
        for host in self._hosts:
            host["tokens"][0] = lanes  # every entry unused: the scratch row
        self.scratch_table = torch.full((lanes + 1, capacities.max_context), UNKNOWN, dtype=torch.int64, device=device)
        self.token_table = self.scratch_table[:lanes]  # the view's; scratch_table's last row is scratch_row
        self.batch, self.sampled = self.device_views["batch"][0, :1], self.device_views["batch"][0, 1:2]
        self._kernels = import_module(".view_kernels", __package__) if fused else None  # triton, when fused
        self._sample_numbers = torch.arange(b, device=device)
        self.lanes = self.device_views["lanes"][0]
        self._pair = 0  # the pair whose staging buffer is filled now
        self._entries = [0] * pairs  # token entries each staging buffer holds
        self._sizes = [(0, 0)] * pairs  # the batch size and sampled count each staging buffer holds
        self._spill: np.ndarray | None = None  # this forward's entries past max_tokens, [3, n]
        self._cleared: Sequence[int] = ()  # the lanes to clear before this forward

    def select(self, pair: int) -> None:
        """Fill pair `pair`'s staging buffer next (the forward that last read it is over)."""
        self._pair = pair

    @property
    def host(self) -> dict[str, np.ndarray]:
        """The selected pair's staging buffer, as numpy views."""
        return self._hosts[self._pair]

    def set_batch(self, size: int, sampled: int) -> None:
        """The number of requests in this forward (rows at or past it are padding) and of the
        tokens it samples (its leading logits indices)."""
        counts = (size, sampled)
        if self._sizes[self._pair] != counts:
            self.host["batch"][0, :2] = self._sizes[self._pair] = counts

    def set_lanes(self, lanes: Sequence[int]) -> None:
        """Batch row r's request holds lane lanes[r]."""
        self.host["lanes"][0, :len(lanes)] = lanes

    def clear_lanes(self, lanes: Sequence[int]) -> None:
        """Every position of these lanes UNKNOWN before this forward's entries (lanes handed to
        another request: no position of it may be checked against its previous request's tokens)."""
        self._cleared = lanes

    def set_entries(self, lanes: Sequence[int], starts: Sequence[int], counts: Sequence[int],
                    tokens: np.ndarray | Sequence[int]) -> None:
        """This forward's new token-table entries, in runs: run i puts the next counts[i] of
        `tokens` (int64 as Lanes.token_entries gives them; a list is converted) at positions
        starts[i], starts[i] + 1, ... of lane lanes[i]."""
        n, held = len(tokens), self._entries[self._pair]
        self._spill = None
        if n == held == 0:  # none, as in the forward before
            return
        entries = self.host["tokens"]
        m = min(n, entries.shape[1])
        if n:
            run_counts = np.asarray(counts, dtype=np.int64)
            firsts = np.cumsum(run_counts) - run_counts  # each run's first entry
            table = entries[:, :n] if n == m else np.empty((3, n), dtype=np.int64)  # written in place if it fits
            table[0] = np.repeat(np.asarray(lanes, dtype=np.int64), run_counts)
            table[1] = np.repeat(np.asarray(starts, dtype=np.int64) - firsts, run_counts)
            table[1] += np.arange(n)
            table[2] = tokens
            if m < n:
                entries[:, :m] = table[:, :m]
                self._spill = table[:, m:]
        if m < held:
            entries[0, m:held] = self.scratch_row
        self._entries[self._pair] = self.host["batch"][0, 2] = m

    def has_direct_writes(self) -> bool:
        """Whether this forward needs ``write_direct``: lanes to clear, or entries past the
        fixed-size part."""
        return bool(self._cleared) or self._spill is not None

    def write_direct(self) -> None:
        """Clear the lanes handed over, then write the entries past the fixed-size part into the
        token table (device work, eager, before the forward). Host data goes through pinned
        memory: a pageable copy would wait for the forward the device still runs (async
        batching) before the host could go on."""
        if self._cleared:
            self.scratch_table.index_fill_(0, self._to_device(np.asarray(self._cleared, dtype=np.int64)), UNKNOWN)
            self._cleared = ()
        if self._spill is not None:
            rows, positions, tokens = self._to_device(self._spill)
            self.scratch_table.index_put_((rows, positions), tokens)
            self._spill = None

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(array)
        if self.scratch_table.is_cuda:
            host = host.pin_memory()
        return host.to(self.scratch_table.device, non_blocking=True)

    def upload(self) -> None:
        """Copy the selected pair's staging buffer to the device (device work; a copy node when
        captured)."""
        self.device_flat.copy_(self.staging[self._pair], non_blocking=True)

    def apply_tokens(self) -> None:
        """token_table[row, position] = token for this forward's entries (device work only)."""
        if self._kernels is not None:
            entries, count = self.device_views["tokens"], self.device_views["batch"][0, 2:]
            self._kernels.apply_entries(entries, count, self.scratch_table)
            return
        rows, positions, tokens = self.device_views["tokens"]
        self.scratch_table.index_put_((rows, positions), tokens)

    def put_tokens(self, lanes: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> None:
        """token_table[lanes[i], positions[i]] = tokens[i] for the forward's sampled tokens (device
        work only; the entries past them, or past the table, go to the scratch row)."""
        n = lanes.shape[0]
        valid = (self._sample_numbers[:n] < self.sampled) & (positions < self.scratch_table.shape[1])
        at = (torch.where(valid, lanes, self.scratch_row), torch.where(valid, positions, 0))
        self.scratch_table.index_put_(at, tokens[:n].long())

    def reset(self) -> None:
        self.scratch_table.fill_(UNKNOWN)

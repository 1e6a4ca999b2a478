"""FaultInjector: arms kv_perturb specs around an engine's forwards and records every injection.

It observes the canary runtime: its before_forward runs before the runtime's HEAD (so HEAD of the
same forward must see the fault), its after_stamp right after the TAIL stamp (so a flip lands
after the stamp, in stream order). With an engine's host tier it also hears every write-back,
load-back and host free, so the ledger follows damage into host memory and back (a host copy is
the place "<side>:host").
"""

from __future__ import annotations

import random
import zlib

import torch

from kvcanary_kernels.records import GroupKind, Half

from ..canary.readout import GroupReadout, SlotBytes
from ..canary.runtime import CanaryRuntime
from ..canary.seam import GuardedEngine, ForwardView, optional
from ..config import SCALE_MODES, PerturbSpec
from .fit import misfit, target
from .ledger import Injection, Ledger, Place
from .targets import Target, cached_only_targets, feeds, read_targets, written_targets

BEFORE_MODES = ("req_to_token", "real_kv_used", "real_kv_unused_cache", "next_token_swap", "real_kv_host",
                "state_wrong_restore") + SCALE_MODES


class PerturbError(ValueError):
    """A kv_perturb spec this engine cannot honour; names the argument and the allowed values."""


class FaultInjector:
    def __init__(self, host: GuardedEngine, runtime: CanaryRuntime, side: str, ledger: Ledger) -> None:
        self.host = host
        self.runtime = runtime
        self.readout = runtime.readout()
        self.side = side
        self.ledger = ledger
        self.specs: tuple[PerturbSpec, ...] = ()
        self._rng = random.Random(0)
        self._freed: dict[int, None] = {}  # INDEXER slots freed since arm, in order (index_stale's targets)
        # (table, row, column, entry) to put back: a remapped entry, or a damaged scale (scales, layer, head, scale)
        self._restore: list[tuple[torch.Tensor, int, int, int | float]] = []
        add_listener = optional(host, "add_free_listener")
        self._hears_frees = add_listener is not None
        if self._hears_frees:
            add_listener(self._on_free)
        self._tier = optional(host, "host_tier")
        self.host_side = f"{side}:host"  # where the ledger places damage the host tier holds
        if self._tier is not None:
            self._tier.add_listener(self)

    def _on_free(self, kind: GroupKind, slots: torch.Tensor, cause: str) -> None:
        """Called before the engine drops the slots (in the group's mapping space: an SWA slot is
        still mapped from its FULL slot, so one whose SWA slot moved frees nothing there). Reads
        the slots (a device sync) only while the ledger follows damage in that group."""
        if self.ledger.follows_frees(self.side, kind):
            self._escape(self.readout.group(kind), slots, cause)
        if kind is GroupKind.INDEXER and any(s.mode == "index_stale" for s in self.specs):
            self._freed.update(dict.fromkeys(slots.tolist()))

    def _escape(self, group: GroupReadout, full_slots: torch.Tensor, cause: str) -> None:
        slots = full_slots if group.kind is GroupKind.STATE else group.group_slots(full_slots.to(torch.int64))
        self.ledger.escape(self.side, group.kind, set(slots[slots != 0].tolist()), cause, self.runtime.forwards)

    def arm(self, specs: tuple[PerturbSpec, ...], seed: int) -> None:
        """Faults for the next run; the same specs and seed replay the same injections."""
        kinds = self.runtime.group_kinds
        fingerprints = any(g.fingerprinted() for g in self.readout.kv_groups)
        for spec in specs:
            why = misfit(spec, kinds, fingerprints_real_kv=fingerprints, engine="this engine")
            if why is None and spec.mode == "real_kv_host" and not self.readout.group(target(spec, kinds)).host_backed:
                why = f"the {target(spec, kinds).label} group of this engine has no host tier to damage"
            if why is not None:
                raise PerturbError(f"kv_perturb({spec.mode!r}): {why}")
        self.specs = tuple(s for s in specs if s.side in (None, self.side))
        self._rng = random.Random(zlib.crc32(f"{seed}/{self.side}".encode()))
        self._restore.clear()
        self._freed.clear()

    def _group(self, spec: PerturbSpec) -> GroupReadout:
        return self.readout.group(target(spec, self.runtime.group_kinds))

    def _due(self, spec: PerturbSpec, modes: tuple[str, ...]) -> bool:
        return (spec.mode in modes and self.runtime.forwards >= spec.warmup_steps
                and self._rng.random() < spec.prob)

    def before_forward(self, view: ForwardView) -> None:
        for spec in self.specs:
            if not self._due(spec, BEFORE_MODES):
                continue
            if spec.mode in SCALE_MODES:
                self._damage_scale(spec, view)
                continue
            group = self._group(spec)
            if spec.mode == "real_kv_unused_cache":
                self._flip(spec, group, cached_only_targets(self.host, group), byte=None)
            elif spec.mode == "real_kv_used":
                self._flip(spec, group, read_targets(view, group), byte=0)
            elif spec.mode == "next_token_swap":
                self._swap(spec, view)
            elif spec.mode == "real_kv_host":
                self._flip_host(spec, group)
            elif spec.mode == "state_wrong_restore":
                self._wrong_restore(spec, group, view)
            else:
                self._remap(spec, group, view)

    def after_stamp(self, view: ForwardView) -> None:
        # Newest first: where two specs damaged one entry, the first saved the original.
        for table, row, column, entry in reversed(self._restore):
            table[row, column] = entry
        self._restore.clear()
        if not self._hears_frees:
            # A rewritten slot's damage is gone unread; engines that report frees said so already
            # (a slot is freed before it can be written again).
            for group in self.readout.kv_groups:
                written = torch.tensor([t.full_slot for t in written_targets(view, group)], dtype=torch.int64)
                self._escape(group, written, "slot overwritten before any read")
        for spec in self.specs:
            if self._due(spec, ("real_kv_post_forward",)):
                group = self._group(spec)
                self._flip(spec, group, written_targets(view, group), byte=None)

    def indices_selected(self, view: ForwardView, layer: int) -> None:
        for spec in self.specs:
            if self._due(spec, ("index_stale",)):
                self._stale_index(spec, view, layer)

    def _stale_index(self, spec: PerturbSpec, view: ForwardView, layer: int) -> None:
        """Point one entry sparse layer ``layer`` selected at a slot its row does not hold: one freed
        since the faults were armed and not live in this forward, else one only the prefix cache
        holds (a finished request's), else another request's slot of this forward (SGLang's class:
        an indexer entry left pointing at a freed slot). The layer's attention then reads another
        token's KV; its SELECT check must name the slot at the selected position. The selection
        is refilled by the next layer."""
        positions, slots = (t.cpu() for t in view.selected)
        used = (positions != -1).nonzero().tolist()
        if not used:
            return
        t, k = self._rng.choice(used)
        starts = view.extend_lens.cpu().cumsum(0)
        b = int((starts <= t).sum())
        row, position = int(view.rows[b]), int(positions[t, k])
        group = self.readout.group(GroupKind.INDEXER)
        live = read_targets(view, group) + written_targets(view, group)
        own = {o.slot for o in live if o.row == row}
        held = {o.slot for o in live}
        candidates = (sorted(set(self._freed) - held) or sorted({o.slot for o in cached_only_targets(self.host, group)})
                      or sorted(held - own))
        made = {(i.step, i.slot, i.position) for i in self.ledger.injections if i.mode == "index_stale"}
        candidates = [s for s in candidates if (self.runtime.forwards, s, position) not in made]
        if not candidates:
            return
        stale = self._rng.choice(candidates)
        view.selected.slots[t, k] = stale
        self._record(spec, group, Target(stale, stale, position, row), -1, None, layer)

    def _flip(self, spec: PerturbSpec, group: GroupReadout, targets: list[Target], byte: int | None) -> None:
        """Flip one bit of a byte the fingerprint reads (``byte``: the index among its sampled bytes,
        None: a random one) of a target slot in a layer the fingerprint reads. Slots that
        already hold a flip are passed over: a second flip could undo the first, and each fault
        stays one violation of its own."""
        damaged = self.ledger.damaged(self.side, group.kind)
        targets = [t for t in targets if t.slot not in damaged]
        if not targets:
            return
        t = self._rng.choice(targets)
        half, layer = self._pick_layer(group)
        offset = self._flip_byte(group.slot_bytes(half, layer, t.slot), byte)
        self._record(spec, group, t, offset, half.name, layer)

    def _pick_layer(self, group: GroupReadout) -> tuple[Half, int]:
        """A half of the group and one of its layers the fingerprint reads."""
        layers = group.fingerprinted()
        half = self._rng.choice(list(layers))
        return half, layers[half][self._rng.randrange(len(layers[half]))]

    def _flip_byte(self, slot: SlotBytes, byte: int | None) -> int:
        """Flip one bit of a byte of the slot the fingerprint reads (its index among the sampled
        bytes, None: a random one); returns the byte's offset in the slot."""
        offset = slot.sampled[self._rng.randrange(len(slot.sampled)) if byte is None else byte]
        slot.data[offset] ^= 1 << self._rng.randrange(8)
        return offset

    def _flip_host(self, spec: PerturbSpec, group: GroupReadout) -> None:
        """Flip a byte the fingerprint reads of a page the host tier holds, while it is there: the
        HEAD of the first forward that reads it after it is loaded back must see it. Recorded at
        the host slot on the place "<side>:host"."""
        self._tier.synchronize()  # no copy into host memory is under way
        damaged = self.ledger.damaged(self.host_side, group.kind)
        targets = [h for h in group.host_slots().tolist() if h not in damaged]
        if not targets:
            return
        slot = self._rng.choice(targets)
        half, layer = self._pick_layer(group)
        offset = self._flip_byte(group.slot_bytes(half, layer, slot, host=True), None)
        position = group.host_position(half, slot)
        self.ledger.record(Injection(
            mode=spec.mode, side=self.host_side, group=group.kind.label, slot=slot, full_slot=slot,
            position=position, row=-1, byte=offset, step=self.runtime.forwards, half=half.name, layer=layer))

    def states_copied(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """A recurrent state copied (a checkpoint restored or saved): damage in it now also lives
        at the destination, from the next forward on."""
        if not self.ledger.injections:
            return
        for s, d in zip(src.tolist(), dst.tolist()):
            if s:
                self.ledger.moved(self.side, GroupKind.STATE, s, Place(self.side, d, d, self.runtime.forwards))

    # HostTierListener: the ledger follows damage into host memory and back.

    def written_back(self, kind: GroupKind, slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        self._follow(kind, slots, host_slots, into_host=True)

    def loaded_back(self, kind: GroupKind, host_slots: torch.Tensor, slots: torch.Tensor) -> None:
        self._follow(kind, slots, host_slots, into_host=False)

    def host_freed(self, kind: GroupKind, host_slots: torch.Tensor, cause: str) -> None:
        if self.ledger.injections:
            self.ledger.escape(self.host_side, kind, set(host_slots.tolist()), cause, self.runtime.forwards)

    def _follow(self, kind: GroupKind, slots: torch.Tensor, host_slots: torch.Tensor, *, into_host: bool) -> None:
        """Damage at these slots (the group's mapping space) now also lives at these host slots (a
        write-back), or the other way round (a load-back), from the next forward on."""
        if not self.ledger.injections:
            return
        step, group = self.runtime.forwards, self.readout.group(kind)
        for space, slot, host in zip(slots.tolist(), group.group_slots(slots).tolist(), host_slots.tolist()):
            if not slot:
                continue
            if into_host:
                self.ledger.moved(self.side, kind, space, Place(self.host_side, host, host, step))
            else:
                self.ledger.moved(self.host_side, kind, host, Place(self.side, slot, space, step))

    def _remap(self, spec: PerturbSpec, group: GroupReadout, view: ForwardView) -> None:
        """Point one mapping entry HEAD reads at another live entry (a slot of a per-token table,
        a block of a block table); restored after the forward. The fault is recorded at the first
        position the entry maps that this forward reads, where the remapped table now maps it. The
        log reports each distinct row once, so a remap an earlier one already made is passed over."""
        targets = read_targets(view, group)
        block, column = group.block_of, group.column_of
        # An entry this forward also writes through stays (the forward would write to the wrong
        # place), and so does the one holding a row's last prefix position (TAIL seeds the row's
        # chain from it, so the damage would outlive the forward).
        writing = {block(w.full_slot) for w in written_targets(view, group)}
        seeds = {(int(r), int(p) - 1) for r, p in zip(view.rows.tolist(), view.prefix_lens.tolist())}
        seed_entries = {(o.row, column(o.position)) for o in targets if (o.row, o.position) in seeds}
        targets = [o for o in targets
                   if block(o.full_slot) not in writing and (o.row, column(o.position)) not in seed_entries]
        if not targets:
            return
        t = self._rng.choice(targets)
        col = column(t.position)
        first = min(o.position for o in targets if o.row == t.row and column(o.position) == col)
        made = {block(i.full_slot) for i in self.ledger.injections
                if (i.mode, i.side, i.row, i.position) == ("req_to_token", self.side, t.row, first)}
        others = sorted({block(o.full_slot) for o in targets} - {block(t.full_slot)} - writing - made)
        if not others:
            return
        wrong = self._rng.choice(others)
        table = group.table
        self._restore.append((table, t.row, col, int(table[t.row, col])))
        table[t.row, col] = wrong
        space, slot = (int(s[0]) for s in group.slots_at(torch.tensor([t.row]), torch.tensor([first])))
        self._record(spec, group, Target(slot, space, first, t.row), -1, None, -1)

    def _damage_scale(self, spec: PerturbSpec, view: ForwardView) -> None:
        """Damage one scale the forward is handed (the view's, the tensors its attention dequantizes
        with): one flipped bit (scale_corrupt) or 1.0 (scale_reset). Put back after the forward, so
        the damage lives for that forward only, which HEAD must report before it reads KV. An entry
        already damaged in this forward is passed over (a second flip could undo the first)."""
        used = self.runtime.scales.used(view)
        half = self._rng.choice(list(used))
        scales = used[half]
        layer, head = self._rng.randrange(scales.shape[0]), self._rng.randrange(scales.shape[1])
        original = float(scales[layer, head])
        if any(t is scales and (r, c) == (layer, head) for t, r, c, _ in self._restore) or (
                spec.mode == "scale_reset" and original == 1.0):
            return
        self._restore.append((scales, layer, head, original))
        if spec.mode == "scale_reset":
            scales[layer, head], byte = 1.0, -1
        else:
            bit = self._rng.randrange(32)
            bits = scales.view(torch.int32)
            bits[layer, head] = int(bits[layer, head]) ^ (1 << bit if bit < 31 else -(1 << 31))
            byte = head * scales.element_size() + bit // 8
        self.ledger.record(Injection(
            mode=spec.mode, side=self.side, group=GroupKind.SCALES.label, slot=layer, full_slot=layer, position=head,
            row=-1, byte=byte, step=self.runtime.forwards, half=half.name, layer=layer))

    def _wrong_restore(self, spec: PerturbSpec, group: GroupReadout, view: ForwardView) -> None:
        """Restore one row's state (past its first token) from the wrong place, as an engine's
        restore path would: from another checkpoint the cache holds, or, when it holds none, from
        a free state slot (a donated slot never written for this prefix). Bytes and records move
        together (`states_copied`), so HEAD of this forward must find the state summarizes another
        prefix than the row's."""
        rows = [t for t in read_targets(view, group) if t.position > 0]
        walk = optional(self.host, "checkpoint_walk")()
        if not rows or walk is None:
            return
        t = self._rng.choice(rows)
        held = set(walk.slots.tolist()) | set(view.state.slots.tolist())
        sources = sorted(set(walk.slots.tolist()) - {t.slot}) or sorted(set(range(1, group.num_slots)) - held)
        if not sources:
            return
        src = self._rng.choice(sources)
        dst = torch.tensor([t.slot], dtype=torch.int64, device=self.runtime.device)
        for layer in group.buffers(Half.K):  # a state group's one half
            layer[dst] = layer[src].clone()
        self.runtime.states_copied(torch.tensor([src], dtype=torch.int64, device=self.runtime.device), dst)
        self._record(spec, group, t, -1, None, -1)

    def _swap(self, spec: PerturbSpec, view: ForwardView) -> None:
        """Feed one request of this forward another token than its newest one (the last token of
        its row whose token the engine knows): the token another request is fed, where one
        differs, else a neighbouring id. Recorded in every pool group where its position has a
        slot: TAIL of this forward stamps what the forward consumed there and reports write_token."""
        feed = optional(self.host, "feed_token")
        if feed is None or view.token_table is None:
            return
        fed = feeds(view)
        if not fed:
            return
        index, row, position = self._rng.choice(fed)
        tokens = view.input_ids.cpu()
        token = int(tokens[index])
        others = sorted({int(tokens[i]) for i, _, _ in fed} - {token})
        feed(view, index, others[0] if others else (token - 1 if token > 0 else token + 1))
        rows, positions = torch.tensor([row], dtype=torch.int64), torch.tensor([position], dtype=torch.int64)
        for group in self.readout.kv_groups:
            space, slot = (int(t[0]) for t in group.slots_at(rows, positions))
            if slot:
                self._record(spec, group, Target(slot, space, position, row), -1, None, -1)

    def _record(self, spec: PerturbSpec, group: GroupReadout, t: Target, byte: int, half: str | None,
                layer: int) -> None:
        self.ledger.record(Injection(
            mode=spec.mode, side=self.side, group=group.kind.label, slot=t.slot, full_slot=t.full_slot,
            position=t.position, row=t.row, byte=byte, step=self.runtime.forwards, half=half, layer=layer))

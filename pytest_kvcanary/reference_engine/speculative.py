"""Speculative decoding: a draft model proposes up to k tokens per request, the target model verifies
them in one forward, and the positions it rejects are rolled back.

The draft is the target's first `draft_layers` layers with its embeddings, final norm and head (a
self-speculative early exit), with a KV pool of its own indexed by the same FULL slots
(`KVPools.draft`). It runs in every forward, before the target, over the slots the target writes:
in a prefill over the same tokens (at positions of its own, view.group_inputs[DRAFT], which TAIL
checks: a retracted request prefilled again gets its draft KV recomputed where it lands), so its KV
covers every token the radix cache holds (and the host tier writes back and loads back); in a decode
over positions [L, L + e) of each request (L = its KV length, e = min(k + 1, tokens it still
needs)), one position per draft forward:

    draft forward j = 0..e-1   input: the last token (j = 0), else its own proposal j, at the
                               forward's position of that token; writes the draft KV of position
                               L + j and proposes the token after it
    view.input_ids, token_table  now hold the last token and the e - 1 proposals
    view.group_inputs[DRAFT]   the draft's own inputs: view.input_ids and the positions each draft
                               forward ran at, which it read from there
    target forward             writes [L, L + e) and predicts the token after each position
    accept                     the proposals the target agrees with, in order, then the target's
                               own next token: 1..e new tokens, so greedy outputs equal plain
                               greedy decoding

For the canary the draft forwards and the target forward are one forward: HEAD before the draft
checks both pools' slots of [0, L), TAIL after the target stamps both pools' slots of [L, L + e)
with the tokens written there, rejected proposals included; the DRAFT group's write-input checks
compare what the draft forwards consumed with the bookkeeping (a draft forward at position L + j + 1
writing the slot of L + j is a write_position). The scheduler then frees the slots of
the rejected positions (`Scheduler.process`; under async scheduling, a decode launched behind this
one runs over them, moved back on the device, and they are freed once it is processed:
async_steps.py); their records are stamped again when a forward writes the slots next.

In a hybrid model the draft's recurrent layers are the target's: they start from each request's
running state (a private copy, `DraftState`; the pool is written by the target only), and the
target's forward writes its state after each proposal into a rollback slot, one of which becomes
the request's state when the scheduler rolls the rejected positions back (scheduler.py). The canary
checks the kept state at the next forward's HEAD like any other: a rollback to the wrong length or
a stale state is a violation there.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvcanary_kernels.records import GroupKind

from .attention import KVStoreListener, PagedKV
from .config import EngineConfig
from .kv_pool import DraftPool
from .model import CausalLM
from .scheduler import Batch
from .state_access import DraftState
from .state_pool import StatePool


class _ViewOrderRows:
    """A store listener for the draft forwards of a decode: each layer's K (and V) rows, gathered
    at the view token indices `index` of the forward running now, for one write-through per layer."""

    def __init__(self, n_tokens: int) -> None:
        self.n_tokens = n_tokens
        self.index: torch.Tensor | None = None
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def __call__(self, kind: GroupKind, layer: int, k: torch.Tensor, v: torch.Tensor | None) -> None:
        def empty(rows: torch.Tensor) -> torch.Tensor:
            return rows.new_empty((self.n_tokens, *rows.shape[1:]))

        k_all, v_all = self.layers.setdefault(layer, (empty(k), None if v is None else empty(v)))
        k_all[self.index] = k
        if v_all is not None:
            v_all[self.index] = v


class Drafter:
    """The draft model over its pool; ``draft`` fills a forward's proposals, ``accept`` checks them."""

    def __init__(self, target: CausalLM, config: EngineConfig, pool: DraftPool, table: torch.Tensor,
                 token_table: torch.Tensor, device: torch.device, states: StatePool | None = None) -> None:
        self.model = CausalLM(replace(config.model, num_layers=config.draft_layers))
        own = self.model.state_dict()
        self.model.load_state_dict({name: t for name, t in target.state_dict().items() if name in own})
        self.model.to(device)
        self.pool, self.table, self.token_table, self.states = pool, table, token_table, states
        self.proposed = 0  # proposals made since the engine started
        self.accepted = 0  # of them, accepted by the target

    def prefill(self, batch: Batch, input_ids: torch.Tensor, positions: torch.Tensor, draft_positions: torch.Tensor,
                contexts: torch.Tensor, on_store: KVStoreListener | None) -> None:
        """The draft's KV of the prefill's tokens, into the slots the target writes (a retracted
        request prefilled again included: its draft KV is recomputed with its target KV). It fills
        draft_positions (the DRAFT group's inputs) with `prefill_positions` and runs there."""
        draft_positions.copy_(self.prefill_positions(batch, positions))
        kv = PagedKV(self.pool, self.table, batch.rows, batch.prefix_lens, batch.extend_lens,
                     draft_positions, batch.out_cache_loc.to(positions.device), on_store=on_store)
        states = None if self.states is None else DraftState(self.states, batch.state_slots).segments(batch.extend_lens)
        self.model(input_ids, draft_positions, kv, contexts, states)

    def prefill_positions(self, batch: Batch, positions: torch.Tensor) -> torch.Tensor:
        """The positions the draft's prefill forward runs at: the forward's positions of its tokens."""
        return positions

    def draft(self, batch: Batch, input_ids: torch.Tensor, positions: torch.Tensor, draft_positions: torch.Tensor,
              contexts: torch.Tensor, on_store: KVStoreListener | None) -> None:
        """One draft forward per decode position of each request. Draft forward j fills its
        entries of draft_positions (the DRAFT group's inputs, per token in view order) with
        step_positions, then reads its positions from there and its tokens from input_ids (the
        view's); it writes the draft KV of positions prefix_len + j into their slots and its
        proposals into input_ids (in place) and the token table. draft_positions thus ends
        holding the position each draft KV row was computed at, for the canary to check against
        its slot's. on_store hears each layer's draft KV rows once, in the view's token order,
        after the last draft forward."""
        device = input_ids.device
        starts = torch.tensor([0] + batch.extend_lens[:-1]).cumsum(0).tolist()
        rows = None if on_store is None else _ViewOrderRows(input_ids.numel())
        states = None if self.states is None else DraftState(self.states, batch.state_slots)
        for j in range(max(batch.extend_lens)):
            live = [b for b, e in enumerate(batch.extend_lens) if e > j]
            index = torch.tensor([starts[b] + j for b in live], device=device)
            draft_positions[index] = self.step_positions(positions, index)
            step = draft_positions[index]
            if rows is not None:
                rows.index = index
            kv = PagedKV(self.pool, self.table, [batch.reqs[b].row for b in live],
                         [batch.prefix_lens[b] + j for b in live], [1] * len(live), step,
                         batch.out_cache_loc.to(device)[index], on_store=rows)
            hidden = self.model(input_ids[index], step, kv, contexts[index],
                                None if states is None else states.steps(torch.tensor(live, device=device)))
            proposals = self.model.compute_logits(hidden).argmax(-1)
            more = [i for i, b in enumerate(live) if batch.extend_lens[b] > j + 1]
            if more:
                input_ids[index[more] + 1] = proposals[more]
                table_rows = torch.tensor([batch.reqs[live[i]].row for i in more], device=device)
                table_positions = torch.tensor([batch.prefix_lens[live[i]] + j + 1 for i in more], device=device)
                self.token_table[table_rows, table_positions] = proposals[more]
        if rows is not None:
            for layer, (k, v) in sorted(rows.layers.items()):
                on_store(GroupKind.DRAFT, layer, k, v)

    def step_positions(self, positions: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The positions one draft forward runs at: the forward's positions of the tokens it
        drafts (view token indices `index`)."""
        return positions[index]

    def accept(self, batch: Batch, input_ids: torch.Tensor, predicted: list[int]) -> list[list[int]]:
        """Per request, the new tokens: the proposals the target's greedy predictions (one per
        token of the forward) agree with, in order, then the target's prediction after the last."""
        tokens, counts = self.accept_on_device(batch, input_ids, torch.tensor(predicted, device=input_ids.device))
        return [row[:n] for row, n in zip(tokens.tolist(), counts.tolist())]

    @staticmethod
    def accept_on_device(batch: Batch, input_ids: torch.Tensor,
                         predicted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`accept` on the device, the host not waiting: each request's new tokens, padded to the
        longest extend ([B, max extend]), and how many of them are its (counts [B], 1..extend)."""
        device, last = predicted.device, predicted.numel() - 1
        extend = torch.tensor(batch.extend_lens, device=device)
        j = torch.arange(max(batch.extend_lens), device=device)
        index = (extend.cumsum(0) - extend)[:, None] + j
        at = index.clamp(max=last)  # past a request's tokens: masked out (agree) or past its count
        agree = (j < extend[:, None] - 1) & (input_ids[(index + 1).clamp(max=last)] == predicted[at])
        return predicted[at], 1 + agree.long().cumprod(1).sum(1)

    def count(self, extend_lens: list[int], new_tokens: list[list[int]]) -> None:
        """Count a processed decode's proposals and, of them, those accepted."""
        self.proposed += sum(extend_lens) - len(extend_lens)
        self.accepted += sum(map(len, new_tokens)) - len(new_tokens)

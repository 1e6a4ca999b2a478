"""What vLLM's model runner hands one forward, read where the forward reads it.

vLLM's CPU model runner (its GPU model runner with host buffers) prepares a step's inputs, enters
its forward context and calls the model with ``input_ids`` and ``positions``. A forward pre-hook on
the model (engine.py) reads, at that call:

- ``input_ids`` and ``positions``: the model call's own arguments (its embedding's token ids, its
  rotary positions);
- ``slot_mappings``: per KV cache group, the forward context's slot mapping of the group's first
  layer, the slot each token's K/V is stored in (every layer of a group shares it; with vLLM's
  hybrid KV cache manager, full-attention and sliding-window layers are groups of their own);
- ``query_start_loc``: the first attention layer's metadata (each request's tokens in the batch;
  the same in every attention group);
- ``seq_lens`` and the block tables (one per KV cache group): the model runner's persistent
  buffers for this step, which the attention metadata slices (vLLM's CPU attention metadata holds
  them as such; its CPU MLA metadata splits them by prefill and decode, so the buffers are read for
  both);
- the request id of each batch row, from the runner's persistent batch.

On vLLM's CUDA build the same fields hold device tensors (FlashAttention's and FlashInfer's
metadata carry ``query_start_loc``; the runner's ``seq_lens`` is a device buffer); with CUDA graphs
``input_ids``, ``positions`` and the slot mappings are padded to the captured size (slot -1),
which the view allows: tokens past the rows' extend lengths are padding. vLLM 0.26 to 0.32 expose all of them; a model fed embeddings instead of token ids (multimodal input) or
multi-dimensional positions (M-RoPE) is refused.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class ForwardInputs(NamedTuple):
    """One forward's inputs, as vLLM hands them to it (tensors on vLLM's device)."""

    request_ids: list[str]  # per batch row
    query_start_loc: torch.Tensor  # [rows + 1]: row b's tokens are [qsl[b], qsl[b + 1])
    seq_lens: torch.Tensor  # [rows]: positions a row's attention reads, its new tokens included
    block_tables: tuple[torch.Tensor, ...]  # per KV cache group: [rows, blocks per request]
    slot_mappings: tuple[torch.Tensor, ...]  # per KV cache group, [tokens]: the slot each token's K/V is
    # stored in (-1: padding)
    input_ids: torch.Tensor  # [tokens] (padded with CUDA graphs)
    positions: torch.Tensor  # [tokens] (padded with CUDA graphs)


def read(runner: Any, model_kwargs: dict[str, Any], group_layers: list[str]) -> ForwardInputs:
    """The inputs of the forward now starting: call inside vLLM's forward context, from a forward
    pre-hook on ``runner.model`` registered with kwargs. group_layers: a layer of each KV cache
    group, in vLLM's group order."""
    from vllm.forward_context import get_forward_context

    input_ids, positions = model_kwargs.get("input_ids"), model_kwargs.get("positions")
    if input_ids is None or positions is None or positions.dim() != 1:
        raise NotImplementedError("the vLLM canary reads a forward's token ids and 1-D positions; this model is "
                                  "fed embeddings or multi-dimensional positions")
    context = get_forward_context()
    rows = runner.input_batch.num_reqs  # the metadata may count padding requests past them (CUDA graphs)
    # the first attention group's (a recurrent group's GDN metadata splits them by spec decoding)
    qsl = next(m.query_start_loc for m in (context.attn_metadata[layer] for layer in group_layers)
               if hasattr(m, "query_start_loc"))[:rows + 1]
    return ForwardInputs(
        request_ids=list(runner.input_batch.req_ids[:rows]),
        query_start_loc=qsl,
        seq_lens=runner.seq_lens[:rows],
        block_tables=tuple(runner.input_batch.block_table[g].get_device_tensor(rows)
                           for g in range(len(group_layers))),
        slot_mappings=tuple(context.slot_mapping[layer] for layer in group_layers),
        input_ids=input_ids,
        positions=positions,
    )

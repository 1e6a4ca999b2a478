"""Triton kernels that stamp and verify KV-cache canary records, and their pure-torch references.

The folder is named as it imports, ``kvcanary_kernels``: a name no other distribution's top-level
``kernels`` package can shadow or be shadowed by in site-packages.

Importing the package (or ``kvcanary_kernels.records``, ``.checks`` or ``.inputs``) imports neither
triton nor torch: the kernels load on first use of a name below. To run them on CPU tensors, set
``TRITON_INTERPRET=1`` before triton is first imported.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> module that defines it
_LAZY = {
    "CHAIN_HEAD_HASH": "hashing",
    "head_hash_int": "hashing",
    "head_hash_torch": "hashing",
    "link_int": "hashing",
    "link_torch": "hashing",
    "mix_int": "hashing",
    "mix_torch": "hashing",
    "to_signed": "hashing",
    "default_tiling": "launch",
    "interpreted": "interpreter",
    "Tiling": "launch",
    "MAX_SOURCES": "sources",
    "RealDataMode": "inputs",
    "RealKvSource": "sources",
    "layer_source": "sources",
    "ViolationRing": "ring",
    "VerifyEntries": "inputs",
    "SlotMapping": "inputs",
    "ForwardView": "inputs",
    "GroupInputs": "inputs",
    "StateInputs": "inputs",
    "ScaleInputs": "inputs",
    "SelectedInputs": "inputs",
    "verify_records": "verify",
    "state_launch": "state_view",
    "verify_view": "view_verify",
    "verify_view_parts": "view_verify",
    "ViewPart": "launch",
    "stamp_view": "view_stamp",
    "stamp_view_parts": "view_stamp",
    "StampPart": "launch",
    "source_hash_rows": "rows_hash",
    "source_hash_rows_parts": "rows_hash",
    "RowsPart": "launch",
    "fingerprint_ref": "reference",
    "map_slot_ref": "reference",
    "mapping_slot_ref": "reference",
    "group_slot_ref": "reference",
    "source_hash_ref": "reference",
    "source_hash_rows_ref": "reference",
    "source_hash_rows_parts_ref": "reference",
    "state_launch_ref": "reference",
    "stamp_view_ref": "reference",
    "stamp_view_parts_ref": "reference",
    "verify_records_ref": "reference",
    "verify_view_ref": "reference",
    "verify_scales": "scale_check",
    "verify_scales_ref": "reference",
    "verify_selected": "index_check",
    "verify_selected_ref": "reference",
    "verify_view_parts_ref": "reference",
}

__all__ = sorted(_LAZY) + ["records"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcanary_kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value

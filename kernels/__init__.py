"""Triton kernels that stamp and verify KV-cache canary records, and their pure-torch references.

Importing needs no GPU. To run the kernels on CPU tensors, set ``TRITON_INTERPRET=1`` before this
package (or triton) is first imported.
"""

from . import records
from .entries import VerifyEntries, WriteEntries
from .hashing import CHAIN_HEAD_HASH, mix3_int, mix3_torch, mix_int, mix_torch, to_signed
from .launch import DEFAULT_TILING, Tiling
from .reference import fingerprint_ref, stamp_records_ref, verify_records_ref
from .ring import ViolationRing
from .sources import MAX_SOURCES, RealDataMode, RealKvSource, layer_source
from .stamp import stamp_records
from .verify import verify_records

__all__ = [
    "CHAIN_HEAD_HASH",
    "DEFAULT_TILING",
    "MAX_SOURCES",
    "RealDataMode",
    "RealKvSource",
    "Tiling",
    "VerifyEntries",
    "ViolationRing",
    "WriteEntries",
    "fingerprint_ref",
    "layer_source",
    "mix3_int",
    "mix3_torch",
    "mix_int",
    "mix_torch",
    "records",
    "stamp_records",
    "stamp_records_ref",
    "to_signed",
    "verify_records",
    "verify_records_ref",
]

"""The storage tier under the host tier (SGLang's HiCache L3: device -> host -> storage): host pages
the radix cache evicts from host memory are stored as files on local disk and loaded back into host
memory on a later hit, then into device pages as the host tier's own pages are.

One file per page, named by its key: the context key (a LoRA adapter or cache salt) and a hash of
every token from the start of the prompt to the page's end (`page_key`), so two contexts never
share an entry and a page is found by its token path. A store writes the whole file under a
temporary name, syncs it, then renames it into place; only then does the index list the key, so a
lookup never sees a partial store, and a store that fails midway is never listed. A file holds a
header (its key, context and page tokens, and the layout of what follows), the page's bytes per
backed pool (FULL, DRAFT), K and V, layer by layer, and the records each host-tier listener keeps
for its slots (the canary's: `HostKVCache.records_of`), which come back with the bytes.

A load checks the file's structure (magic, lengths, layout) and that its header names the key, the
context and the tokens asked for; a file that fails is refused (a miss, counted in `refused` by
reason: "missing", "torn", "another context", "another page"). The page's bytes are not checked
here: the canary's records, restored beside them, are what the first forward reading them verifies.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from pathlib import Path
from typing import BinaryIO, Sequence

import torch

from kvcanary_kernels.records import GroupKind, Half

from .config import EngineConfig
from .host_tier import HostKVCache

MAGIC, END = b"KVCPAGE1", b"KVCEND01"
SUFFIX = ".kvpage"
REFUSALS = ("missing", "torn", "another context", "another page")


def page_key(context: int, prefix: Sequence[int]) -> str:
    """The key of the page ending `prefix` (every token from the start of the prompt) under
    `context`: the file's name, less its suffix."""
    digest = hashlib.sha256(torch.tensor(list(prefix), dtype=torch.int64).numpy().tobytes()).hexdigest()[:32]
    return f"{context % 2 ** 64:016x}-{digest}"


class DiskTier:
    """Page files in config.disk_dir, at most config.disk_num_pages of them, of `host`'s page size.
    index: the keys of complete files (what a lookup sees) and their sizes. num_stored / num_loaded:
    pages stored and loaded since the engine started; num_failed_stores: stores that raised (never
    listed); refused: loads refused, by reason."""

    def __init__(self, config: EngineConfig, host: HostKVCache) -> None:
        self.dir = Path(config.disk_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.host, self.page_size, self.num_pages = host, host.page_size, config.disk_num_pages
        self.index: dict[str, int] = {}
        self.num_stored = self.num_loaded = self.num_failed_stores = 0
        self.refused: Counter[str] = Counter()

    @property
    def num_free(self) -> int:
        """Pages that may still be stored."""
        return self.num_pages - len(self.index)

    def path(self, key: str) -> Path:
        return self.dir / f"{key}{SUFFIX}"

    def store(self, context: int, prefix: Sequence[int], host_slots: torch.Tensor) -> str | None:
        """Store the page in these host slots, the last page of `prefix` under `context`; its key,
        or None when the store failed (nothing listed; the caller keeps or drops the host copy).
        Storing a key again replaces its file."""
        key = page_key(context, prefix)
        self.host.synchronize()  # every write-back has landed: host memory may be read
        data = self._encode(key, context, list(prefix[-self.page_size:]), host_slots)
        final = self.path(key)
        temp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        try:
            with open(temp, "wb") as f:
                self._write(f, data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, final)
            self._sync_dir()
        except OSError:
            self.num_failed_stores += 1
            self._discard(temp)
            return None
        self.index[key] = len(data)
        self.num_stored += 1
        return key

    def load(self, key: str, context: int, tokens: Sequence[int], host_slots: torch.Tensor) -> bool:
        """Load the page stored under key (whose header must name `context` and its `tokens`) into
        these host slots, its records with it; False when refused (counted by reason; a torn file
        is deleted). The file stays until `delete`."""
        reason = self._read_into(key, context, list(tokens), host_slots)
        if reason is None:
            self.num_loaded += 1
            return True
        assert reason in REFUSALS, reason
        self.refused[reason] += 1
        if reason == "torn":
            self.delete([key])
        return False

    def delete(self, keys: Sequence[str]) -> None:
        """Remove these pages' files (those not listed are skipped)."""
        for key in keys:
            if self.index.pop(key, None) is not None:
                self._discard(self.path(key))

    def _read_into(self, key: str, context: int, tokens: list[int], host_slots: torch.Tensor) -> str | None:
        if key not in self.index:
            return "missing"
        try:
            data = self.path(key).read_bytes()
        except OSError:
            return "missing"
        decoded = self._decode(data, host_slots.numel())
        if decoded is None:
            return "torn"
        header, tensors = decoded
        if header["context"] != context % 2 ** 64:
            return "another context"
        if header["key"] != key or header["tokens"] != tokens:
            return "another page"
        self.host.synchronize()  # no copy still reads or writes these host slots
        pages = {pool.kind.label: pool for pool in self.host.kv_pools}
        records: dict[tuple[int, GroupKind, Half], torch.Tensor] = {}
        for name, t in tensors.items():
            what, label, rest = name.split(".")
            if what == "kv":
                pool = pages[label]
                layers = pool.k_layers if rest[0] == "K" else pool.v_layers
                layers[int(rest[1:])][host_slots] = t
            else:
                records[(int(what[7:]), GroupKind.from_label(label), Half[rest])] = t
        self.host.restore_records(host_slots, records)
        return None

    def _sections(self, host_slots: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """What a page's file holds past its header: "kv.<pool>.<K|V><layer>" per backed pool and
        layer, "records<listener>.<pool>.<half>" per listener keeping records."""
        layers = [t for pool in self.host.kv_pools for t in (*pool.k_layers, *pool.v_layers)]
        sections = [(name, t[host_slots]) for (name, _, _), t in zip(self._kv_layout(host_slots.numel()), layers,
                                                                     strict=True)]
        for j, held in enumerate(self.host.records_of(host_slots)):
            sections += [(f"records{j}.{kind.label}.{half.name}", rows) for (kind, half), rows in held.items()]
        return sections

    def _kv_layout(self, n: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """The KV sections of a page of n slots: name, dtype, shape."""
        return [(f"kv.{pool.kind.label}.{half}{i}", t.dtype, (n, *t.shape[1:]))
                for pool in self.host.kv_pools
                for half, layers in (("K", pool.k_layers), ("V", pool.v_layers)) for i, t in enumerate(layers)]

    def _encode(self, key: str, context: int, tokens: list[int], host_slots: torch.Tensor) -> bytes:
        sections = self._sections(host_slots)
        header = json.dumps({"key": key, "context": context % 2 ** 64, "tokens": tokens,
                             "sections": [[name, str(t.dtype).removeprefix("torch."), list(t.shape)]
                                          for name, t in sections]}).encode()
        payload = b"".join(t.contiguous().cpu().view(torch.uint8).numpy().tobytes() for _, t in sections)
        return b"".join([MAGIC, len(header).to_bytes(8, "little"), header, len(payload).to_bytes(8, "little"),
                         payload, END])

    def _decode(self, data: bytes, n: int) -> tuple[dict, dict[str, torch.Tensor]] | None:
        """The header and the sections of a whole file, or None when it is torn (short, long, or
        not laid out as this tier's pages of n slots are)."""
        if len(data) < 32 or data[:8] != MAGIC or data[-8:] != END:
            return None
        size = int.from_bytes(data[8:16], "little")
        try:
            header = json.loads(data[16:16 + size])
            layout = [(name, getattr(torch, dtype), tuple(shape)) for name, dtype, shape in header["sections"]]
            header = {field: header[field] for field in ("key", "context", "tokens")}
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        start = 16 + size + 8
        payload = int.from_bytes(data[16 + size:start], "little")
        if start + payload + 8 != len(data):
            return None
        if [x for x in layout if x[0].startswith("kv.")] != self._kv_layout(n):
            return None
        tensors, at = {}, start
        for name, dtype, shape in layout:
            nbytes = torch.empty(shape, dtype=dtype).numel() * torch.empty(0, dtype=dtype).element_size()
            if at + nbytes > start + payload:
                return None
            raw = bytearray(data[at:at + nbytes])
            tensors[name] = (torch.frombuffer(raw, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
                             ).view(dtype).reshape(shape)
            at += nbytes
        return (header, tensors) if at == start + payload else None

    @staticmethod
    def _write(f: BinaryIO, data: bytes) -> None:
        f.write(data)

    @staticmethod
    def _discard(path: Path) -> None:
        try:
            path.unlink()
        except OSError:
            pass

    def _sync_dir(self) -> None:
        """The rename itself made durable (POSIX: sync the directory)."""
        if os.name != "posix":
            return
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

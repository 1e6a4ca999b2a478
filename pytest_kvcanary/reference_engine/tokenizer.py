"""A byte-level tokenizer: token id = UTF-8 byte (0..255). Ids above 255 (the rest of a larger
vocabulary) have no text and decode as U+FFFD."""

from __future__ import annotations


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        out, pending = [], bytearray()
        for i in ids:
            if 0 <= i < self.vocab_size:
                pending.append(i)
                continue
            out.append(pending.decode("utf-8", errors="replace") + "\ufffd")
            pending.clear()
        return "".join(out) + pending.decode("utf-8", errors="replace")

"""The tokenizer the adapters' seeded random checkpoints ship: one token per byte, built locally."""

from __future__ import annotations

from typing import Any

PAD, BOS, EOS = "<pad>", "<s>", "</s>"  # ids 256, 257, 258


def byte_tokenizer() -> Any:
    """A PreTrainedTokenizerFast with one token per UTF-8 byte and ids 256-258 for pad, bos, eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({PAD: 256, BOS: 257, EOS: 258})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD, bos_token=BOS, eos_token=EOS)

"""A tiny byte-level BPE tokenizer built locally (no hub downloads), for tests.

Thin re-export of :mod:`rlhf.quickstart.tiny` (the product code), kept so tests can write::

    from tests.support.tiny_tokenizer import make_tiny_tokenizer
    tok = make_tiny_tokenizer()                 # PreTrainedTokenizerFast with a chat template
    tok = make_tiny_tokenizer(chat_template=False)
    path = save_tiny_tokenizer(tmp_path / "tok")  # for AutoTokenizer.from_pretrained(path)

Properties:
* byte-level, so any text encodes (no unk); digits are split one per token;
* special tokens: ``<|pad|>`` (id 0), ``<|im_start|>`` (1), ``<|im_end|>`` (2, also EOS),
  ``<|endoftext|>`` (3);
* ChatML-style chat template (``<|im_start|>role\\ncontent<|im_end|>\\n``), generation
  prompt ``<|im_start|>assistant\\n``;
* deterministic: the trained vocabulary is cached per ``vocab_size``; every call returns a
  fresh tokenizer object, so tests may mutate it freely.
"""

from __future__ import annotations

from rlhf.quickstart.tiny import (  # noqa: F401
    CHAT_TEMPLATE,
    DEFAULT_CORPUS,
    EOT,
    IM_END,
    IM_START,
    PAD,
    SPECIAL_TOKENS,
    make_tiny_tokenizer,
    save_tiny_tokenizer,
)

__all__ = ["make_tiny_tokenizer", "save_tiny_tokenizer", "CHAT_TEMPLATE", "SPECIAL_TOKENS", "DEFAULT_CORPUS"]

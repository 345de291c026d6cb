"""A tiny byte-level BPE tokenizer built locally (no hub downloads), for tests.

    from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
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

import functools
from pathlib import Path
from typing import Optional, Sequence, Union

__all__ = ["make_tiny_tokenizer", "save_tiny_tokenizer", "CHAT_TEMPLATE", "SPECIAL_TOKENS", "DEFAULT_CORPUS"]

PAD, IM_START, IM_END, EOT = "<|pad|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END, EOT]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

DEFAULT_CORPUS = [
    "Tom has 3 apples and buys 4 more. How many apples does Tom have?",
    "Ann has 7 books and gives away 2. How many books does Ann have left?",
    "Sam has 2 boxes with 5 pens in each box. How many pens does Sam have?",
    "Let's think step by step and output the final answer after \"####\".",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
    "The answer is 72. #### 72",
    "user assistant system",
    "3+4=7 5-2=3 6*7=42 1,000 18.00",
] * 4


@functools.lru_cache(maxsize=8)
def _trained_json(vocab_size: int, corpus: tuple) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    return tok.to_str()


def make_tiny_tokenizer(
    vocab_size: int = 400, chat_template: Union[bool, str] = True, corpus: Optional[Sequence[str]] = None
):
    """A fresh ``transformers.PreTrainedTokenizerFast`` (see module docstring).

    Args:
        vocab_size: BPE vocabulary size (>= 260: 4 specials + 256 bytes).
        chat_template: True = ChatML template above, False = none, or a custom jinja string.
        corpus: training texts (default: a few GSM8K / arithmetic sentences).
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    js = _trained_json(int(vocab_size), tuple(corpus) if corpus is not None else tuple(DEFAULT_CORPUS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(js),
        pad_token=PAD,
        eos_token=IM_END,
        additional_special_tokens=[IM_START, EOT],
        padding_side="left",
    )
    if chat_template is True:
        tok.chat_template = CHAT_TEMPLATE
    elif isinstance(chat_template, str):
        tok.chat_template = chat_template
    return tok


def save_tiny_tokenizer(path: Union[str, Path], **kwargs) -> Path:
    """Save :func:`make_tiny_tokenizer(**kwargs)` to ``path`` (loadable with
    ``AutoTokenizer.from_pretrained(path)``) and return the path."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    make_tiny_tokenizer(**kwargs).save_pretrained(str(p))
    return p

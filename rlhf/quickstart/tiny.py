"""Tiny tokenizer and tiny Llama/Qwen2 causal LMs built locally (no hub downloads).

Used by the quickstart (``model.path=tiny://quickstart``, see :mod:`rlhf.quickstart.model`)
and by the tests (``tests/support/tiny_tokenizer.py`` / ``tiny_models.py`` re-export these).

Tokenizer (:func:`make_tiny_tokenizer`)
---------------------------------------
* byte-level BPE trained in-process on a few sentences, so any text encodes (no unk);
  digits are split one per token;
* special tokens: ``<|pad|>`` (id 0), ``<|im_start|>`` (1), ``<|im_end|>`` (2, also EOS),
  ``<|endoftext|>`` (3);
* ChatML-style chat template (``<|im_start|>role\\ncontent<|im_end|>\\n``), generation
  prompt ``<|im_start|>assistant\\n``;
* deterministic: the trained vocabulary is cached per ``(vocab_size, corpus)``; every call
  returns a fresh tokenizer object, so callers may mutate it freely.

Models
------
* :func:`build_tiny_hf_model` returns an in-memory HF model of a named ``kind`` (see
  :data:`TINY_CONFIGS`), either with HF's own initialisation (``init="hf"``, for training)
  or with large random weights (``init="random"``, std 0.1, so logits are far from
  uniform and layout mistakes show in conversion tests).
* :func:`make_tiny_hf_model` writes such a random model (and optionally a tokenizer) to a
  directory (the test helper's historical behaviour).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

__all__ = [
    "make_tiny_tokenizer",
    "save_tiny_tokenizer",
    "make_tiny_hf_model",
    "build_tiny_hf_model",
    "TINY_CONFIGS",
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "DEFAULT_CORPUS",
    "PAD",
    "IM_START",
    "IM_END",
    "EOT",
]

# --------------------------------------------------------------------------- tokenizer

PAD, IM_START, IM_END, EOT = "<|pad|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END, EOT]
PAD_ID, IM_START_ID, IM_END_ID, EOT_ID = 0, 1, 2, 3

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
    "Maria sold cookies to 36 of her neighbours in June, and then she sold half as many cookies in July.",
    "How many cookies did Maria sell altogether in June and July?",
    "Leo earns $15 an hour for gardening. Yesterday, he just did 40 minutes of gardening.",
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
    """A fresh ``transformers.PreTrainedTokenizerFast`` (see the module docstring).

    Args:
        vocab_size: BPE vocabulary size (>= 260: 4 specials + 256 bytes). The trainer may
            stop below it when the corpus has no more merges.
        chat_template: True = the ChatML template above, False = none, or a custom jinja string.
        corpus: training texts (default: :data:`DEFAULT_CORPUS`, a few GSM8K-style word-problem /
            arithmetic sentences written for this project).
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
    """Save :func:`make_tiny_tokenizer(**kwargs) <make_tiny_tokenizer>` to ``path`` (loadable
    with ``AutoTokenizer.from_pretrained(path)``) and return the path."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    make_tiny_tokenizer(**kwargs).save_pretrained(str(p))
    return p


# --------------------------------------------------------------------------- models

# name -> (config class name, kwargs)
TINY_CONFIGS = {
    # Llama with grouped-query attention (4 q heads, 2 kv heads), untied, vocab not a multiple of 64
    "llama_gqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    # Llama with multi-head attention
    "llama_mha": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)),
    # Qwen2: q/k/v bias, tied embeddings, GQA
    "qwen2_tied": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    # square MLP (intermediate == hidden), rope theta not the default
    "llama_square": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                         rope_theta=500000.0, tie_word_embeddings=False)),
    # Qwen3-MoE (Qwen3-30B-A3B's routing: softmax top-k renormalised, every layer sparse), 8 experts top-2,
    # q/k norm; the MoE quickstart model (tiny://quickstart-moe)
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                                         num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                                         decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
                                         tie_word_embeddings=False)),
}

_INITS = ("random", "hf")


def build_tiny_hf_model(kind: str = "llama_gqa", vocab_size: int = 1000, hidden_size: int = 64, num_layers: int = 4,
                        seed: int = 0, dtype: torch.dtype = torch.float32, init: str = "random",
                        max_position_embeddings: int = 512, **overrides: Any):
    """An in-memory tiny HF causal LM of ``kind`` (see :data:`TINY_CONFIGS`).

    Args:
        kind: a key of :data:`TINY_CONFIGS`.
        vocab_size, hidden_size, num_layers: sizes (``intermediate_size`` defaults to
            ``2 * hidden_size``).
        seed: ``torch.manual_seed`` used for the initialisation (deterministic).
        dtype: parameter dtype.
        init: ``"random"``: every weight ~ N(0, 0.1) and norms ~ 1 + N(0, 0.1), so logits
            are far from uniform (for layout / conversion checks); ``"hf"``: the model's own
            initialisation (``initializer_range``), for training.
        max_position_embeddings: RoPE table length.
        overrides: extra config fields (e.g. ``intermediate_size``, ``bos_token_id``,
            ``eos_token_id``, ``pad_token_id``; token ids default to 1 / 2 / 3).

    Raises:
        KeyError: unknown ``kind``.  ValueError: unknown ``init``.
    """
    import transformers

    if kind not in TINY_CONFIGS:
        raise KeyError(f"build_tiny_hf_model: unknown kind {kind!r}; use one of {sorted(TINY_CONFIGS)}.")
    if init not in _INITS:
        raise ValueError(f"build_tiny_hf_model: init={init!r}; use one of {_INITS}.")
    cls_name, kw = TINY_CONFIGS[kind]
    kw = dict(kw)
    rope_theta = kw.pop("rope_theta", None)
    kw.setdefault("intermediate_size", 2 * hidden_size)
    kw.update(overrides)
    for key, default in (("bos_token_id", 1), ("eos_token_id", 2), ("pad_token_id", 3), ("rms_norm_eps", 1e-6)):
        kw.setdefault(key, default)
    cfg = getattr(transformers, cls_name)(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        max_position_embeddings=max_position_embeddings, **kw)
    if rope_theta is not None:
        if getattr(cfg, "rope_parameters", None) is not None:
            cfg.rope_parameters["rope_theta"] = rope_theta
        else:
            cfg.rope_theta = rope_theta
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if init == "random":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                else:
                    p.normal_(0.0, 0.1)
    return model


def make_tiny_hf_model(out_dir: str, kind: str = "llama_gqa", vocab_size: int = 1000, hidden_size: int = 64,
                       num_layers: int = 4, seed: int = 0, tokenizer=None, dtype=torch.float32, **overrides) -> str:
    """Write a random tiny HF model of ``kind`` (see :data:`TINY_CONFIGS`) to ``out_dir``; returns ``out_dir``.

    Weights are random with std 0.1 so logits are far from uniform and layout mistakes show
    (``build_tiny_hf_model(..., init="random")``). ``tokenizer`` (optional) is saved next to it.
    """
    model = build_tiny_hf_model(kind, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
                                seed=seed, dtype=dtype, init="random", **overrides)
    model.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir

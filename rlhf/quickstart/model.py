"""``tiny://quickstart``: a tiny Llama built locally and warmed up on the embedded arithmetic task.

The quickstart must run PPO on a CPU with no downloads, and RL needs a policy that is right
*sometimes*: a random model never writes ``#### N`` (reward always 0, no signal) and a fully
trained one is always right (no signal either). :func:`build_quickstart_model` therefore

1. trains the tiny byte-level BPE tokenizer (:func:`rlhf.quickstart.tokenizer.make_quickstart_tokenizer`,
   ChatML template, EOS ``<|im_end|>``, digits split; its default corpus plus the task's words);
2. builds a tiny Llama (2 layers, hidden 64, 4 heads / 2 KV heads, untied, fp32, HF init;
   125k parameters; 32768 positions, so verl's commands' lengths fit);
3. runs a short supervised warm-up (:func:`rlhf.quickstart.sft.sft_warmup`: plain torch, one
   thread, AdamW, teacher forcing, loss on the response tokens only) on the task's worked
   solutions, each followed by EOS; the prompt is rendered exactly as
   :class:`rlhf.data.rl_dataset.RLHFDataset` renders it (chat template,
   ``add_generation_prompt=True``, no extra special tokens);
4. saves model + tokenizer + ``generation_config.json`` (EOS / pad / BOS ids only) and a
   ``warmup_meta.json`` recording every argument: a later call with the same arguments
   reuses the directory (idempotent cache; builds are locked against concurrent callers).

How the partial competence is made (``answer_noise``): in 60 % of the warm-up
demonstrations the final ``#### N`` line misreports the (correctly) computed result by
+-1 or +-2 (:func:`rlhf.quickstart.sft.corrupt_answers`). The warmed-up model therefore computes the sum well
(greedy accuracy high) but reports it faithfully only part of the time when sampling, and
the fix is one behaviour shared by every problem, which on-policy RL learns in a few dozen
updates. Plain under-training was tried first: its errors are spread over many tokens and
policy-gradient RL did not improve it (often made greedy accuracy worse).

Measured with the defaults (2 shared cores, single-threaded build; 100 held-out rows):

* build: ~12-15 s (300 steps); response loss 6.0 -> 0.15 per token;
* greedy accuracy 0.76 (seeds 1 / 2: 0.86 / 0.98); sampled T=1 reward 0.35 (0.31 / 0.36);
  answer format and EOS ~100 %;
* simulated GRPO in plain torch (16 prompts x 8 samples, 4 Adam updates per step,
  lr 1e-4, 25 steps): batch reward 0.43 -> 0.77 (first / last 5 steps), held-out sampled
  reward 0.34 -> 0.78, greedy 0.76 -> 0.95.

``task=BOXED_TASK`` (:mod:`rlhf.quickstart.arithmetic`) warms it up on MATH-style problems answered with
``\\boxed{N}`` instead (the MATH rule reward scores them; ``write_math_parquet`` writes them in verl's layout).

The RL task must be generated with the settings the model was warmed up on: use
:func:`rlhf.quickstart.arithmetic.quickstart_task_kwargs` (or read ``warmup_meta.json["task"]``), e.g.
``make_arithmetic_dataset(n, seed=s, **quickstart_task_kwargs(max_operand))``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch

from .arithmetic import QUICKSTART_MAX_OPERAND, make_arithmetic_dataset, quickstart_task_kwargs
from .resolve import QUICKSTART_MAX_POSITION_EMBEDDINGS
from .sft import corrupt_answers, sft_warmup
from .tokenizer import QUICKSTART_VOCAB_SIZE, encode_example, make_quickstart_tokenizer

logger = logging.getLogger(__name__)

__all__ = [
    "QUICKSTART_SCHEME",
    "QUICKSTART_INIT_SCHEME",
    "CALC_SCHEME",
    "QUICKSTART_MOE_SCHEME",
    "QUICKSTART_DEFAULTS",
    "META_FILE",
    "build_quickstart_model",
    "built_quickstart_model",
    "resolve_model_path",
]

QUICKSTART_SCHEME = "tiny://quickstart"
#: the quickstart model before its warm-up: the same tokenizer, architecture and initial weights (seed), 0 warm-up
#: steps, in a directory of its own (``<cache>/tiny_quickstart_init``) so it never replaces the warmed-up one
QUICKSTART_INIT_SCHEME = "tiny://quickstart-init"
#: the quickstart-sized model warmed up on the calculator tool task (rlhf.quickstart.calc), ``<cache>/tiny_calc_model``
CALC_SCHEME = "tiny://calc"
#: the same recipe on a tiny Qwen3-MoE (rlhf.quickstart.tiny.TINY_CONFIGS["qwen3_moe"]: 8 experts, top-2), built and
#: warmed up the same way in ``<cache>/tiny_quickstart_moe`` (recipe moe_r3_tiny_cpu: MoE routing replay)
QUICKSTART_MOE_SCHEME = "tiny://quickstart-moe"
META_FILE = "warmup_meta.json"
_META_VERSION = 3  # 2: max_position_embeddings 1024; 3: 32768

# Defaults of build_quickstart_model (tuned; see module docstring).
QUICKSTART_DEFAULTS: Dict[str, Any] = {
    "seed": 0,
    "warmup_steps": 300,
    "warmup_lr": 3e-3,
    "max_operand": QUICKSTART_MAX_OPERAND,
    "num_layers": 2,
    "hidden_size": 64,
    "batch_size": 32,
    "vocab_size": QUICKSTART_VOCAB_SIZE,
    "answer_noise": 0.6,
}

_WARMUP_DATA_SEED_OFFSET = 7919  # warm-up problems come from their own RNG stream


def _meta(seed, warmup_steps, warmup_lr, max_operand, num_layers, hidden_size, batch_size, vocab_size,
          task, answer_noise, kind="llama_gqa") -> Dict[str, Any]:
    return {**({} if kind == "llama_gqa" else {"kind": kind}),
        "version": _META_VERSION,
        "seed": int(seed),
        "warmup_steps": int(warmup_steps),
        "warmup_lr": float(warmup_lr),
        "max_operand": int(max_operand),
        "num_layers": int(num_layers),
        "hidden_size": int(hidden_size),
        "batch_size": int(batch_size),
        "vocab_size": int(vocab_size),
        "answer_noise": float(answer_noise),
        "task": {k: (list(v) if isinstance(v, tuple) else v)
                 for k, v in quickstart_task_kwargs(max_operand, task).items()},
    }


def _is_complete(d: Path) -> bool:
    has_weights = (d / "model.safetensors").exists() or (d / "pytorch_model.bin").exists()
    needed = ("config.json", "tokenizer.json", "generation_config.json", META_FILE)
    return has_weights and all((d / f).exists() for f in needed)


def _read_meta(d: Path) -> Optional[Dict[str, Any]]:
    try:
        return json.loads((d / META_FILE).read_text())
    except (OSError, ValueError):
        return None


def build_quickstart_model(
    out_dir: Union[str, os.PathLike],
    *,
    seed: int = QUICKSTART_DEFAULTS["seed"],
    warmup_steps: int = QUICKSTART_DEFAULTS["warmup_steps"],
    warmup_lr: float = QUICKSTART_DEFAULTS["warmup_lr"],
    max_operand: int = QUICKSTART_DEFAULTS["max_operand"],
    num_layers: int = QUICKSTART_DEFAULTS["num_layers"],
    hidden_size: int = QUICKSTART_DEFAULTS["hidden_size"],
    batch_size: int = QUICKSTART_DEFAULTS["batch_size"],
    vocab_size: int = QUICKSTART_DEFAULTS["vocab_size"],
    task: Optional[Dict[str, Any]] = None,
    answer_noise: float = QUICKSTART_DEFAULTS["answer_noise"],
    force: bool = False,
    log_every: int = 0,
    kind: str = "llama_gqa",
) -> str:
    """Build (or reuse) the warmed-up tiny quickstart model in ``out_dir``; returns ``str(out_dir)``.

    Args:
        out_dir: target directory (created). If it already holds a complete model whose
            ``warmup_meta.json`` matches every argument below, it is reused as is.
        seed: seeds the model initialisation, the warm-up problems and their order.
        warmup_steps: AdamW steps of supervised warm-up (0 = untrained model).
        warmup_lr: peak learning rate (linear warm-up over 10 % of the steps, then cosine to 10 %).
        answer_noise: fraction of warm-up demonstrations whose final ``#### N`` misreports
            the result (see :func:`corrupt_answers`); sets the sampled reward (~1 - noise
            times the arithmetic accuracy) the RL starts from.
        max_operand: operands of the arithmetic task are in ``[task.min_operand, max_operand]``.
        num_layers, hidden_size: model size (4 heads, 2 KV heads, MLP 2x hidden, untied).
        batch_size: sequences per warm-up step.
        vocab_size: tokenizer BPE size (the embedding has exactly ``len(tokenizer)`` rows).
        task: override :data:`QUICKSTART_TASK` (``style``, ``ops``, ``min_operand``; the RL
            dataset must then use ``quickstart_task_kwargs(max_operand, task)``).
        force: rebuild even if a matching cache exists.
        log_every: log the warm-up loss every this many steps (0 = start/end only).
        kind: the architecture, a key of rlhf.quickstart.tiny.TINY_CONFIGS ("qwen3_moe": tiny://quickstart-moe).

    Raises:
        ValueError: negative ``warmup_steps`` or non-positive sizes / lr.
    """
    if warmup_steps < 0 or batch_size < 1 or num_layers < 1 or hidden_size < 8 or not warmup_lr > 0:
        raise ValueError(
            f"build_quickstart_model: invalid settings warmup_steps={warmup_steps}, warmup_lr={warmup_lr}, "
            f"batch_size={batch_size}, num_layers={num_layers}, hidden_size={hidden_size}.")
    out = Path(out_dir)
    meta = _meta(seed, warmup_steps, warmup_lr, max_operand, num_layers, hidden_size, batch_size, vocab_size, task,
                 answer_noise, kind)
    if not force and _is_complete(out) and _read_meta(out) == meta:
        logger.info("tiny://quickstart: reusing the model in %s (%d warm-up steps)", out, warmup_steps)
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Several processes (ranks, actor + critic) may resolve the same path at once: one builds,
    # the others wait on the lock and then reuse. The caller's RNG state is left untouched.
    # The warm-up runs single-threaded: for a model this small threads only add overhead (and
    # thrash on a busy machine), and one thread makes the result independent of the core count.
    with _file_lock(out.parent / f".{out.name}.lock"), torch.random.fork_rng(devices=[]), _num_threads(1):
        if not force and _is_complete(out) and _read_meta(out) == meta:
            logger.info("tiny://quickstart: reusing the model in %s (%d warm-up steps; built by another process)", out,
                        warmup_steps)
            return str(out)
        _build(out, meta, seed=seed, warmup_steps=warmup_steps, warmup_lr=warmup_lr, max_operand=max_operand,
               num_layers=num_layers, hidden_size=hidden_size, batch_size=batch_size, vocab_size=vocab_size,
               task=task, answer_noise=answer_noise, log_every=log_every, kind=kind)
    return str(out)


@contextlib.contextmanager
def _num_threads(n: int):
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


@contextlib.contextmanager
def _file_lock(path: Path):
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX: no cross-process lock
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _build(out: Path, meta: Dict[str, Any], *, seed, warmup_steps, warmup_lr, max_operand, num_layers, hidden_size,
           batch_size, vocab_size, task, answer_noise, log_every, kind="llama_gqa") -> None:
    from .tiny import IM_END_ID, IM_START_ID, PAD_ID, build_tiny_hf_model

    t0 = time.time()
    calc = (task or {}).get("style") == "calc"
    tok = make_quickstart_tokenizer(vocab_size, calc=calc)
    assert tok.pad_token_id == PAD_ID and tok.eos_token_id == IM_END_ID
    model = build_tiny_hf_model(
        kind, vocab_size=len(tok), hidden_size=hidden_size, num_layers=num_layers, seed=seed,
        init="hf", dtype=torch.float32, bos_token_id=IM_START_ID, eos_token_id=IM_END_ID, pad_token_id=PAD_ID,
        max_position_embeddings=QUICKSTART_MAX_POSITION_EMBEDDINGS)

    task_kw = quickstart_task_kwargs(max_operand, task)
    if calc:  # tiny://calc: multi-turn tool-call demonstrations (rlhf.quickstart.calc)
        from .calc import calc_warmup_examples, make_calc_dataset

        rows = make_calc_dataset(max(1, warmup_steps * batch_size), seed=seed + _WARMUP_DATA_SEED_OFFSET,
                                 split="warmup", **task_kw)
        examples = calc_warmup_examples(tok, rows, answer_noise, seed=seed + _WARMUP_DATA_SEED_OFFSET)
    else:
        rows = make_arithmetic_dataset(max(1, warmup_steps * batch_size), seed=seed + _WARMUP_DATA_SEED_OFFSET,
                                       split="warmup", **task_kw)
        if answer_noise > 0:
            rows = corrupt_answers(rows, answer_noise, seed=seed + _WARMUP_DATA_SEED_OFFSET)
        examples = [encode_example(tok, r["prompt"], r["solution"]) for r in rows]

    losses = sft_warmup(model, examples, PAD_ID, steps=warmup_steps, lr=warmup_lr, batch_size=batch_size, seed=seed,
                        log_every=log_every)

    model.generation_config.eos_token_id = [IM_END_ID]
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.bos_token_id = IM_START_ID
    # Only token ids here: sampling parameters come from the rollout config (SGLang would
    # otherwise take generation_config.json sampling fields as its defaults).

    # Write to a temporary sibling and move into place, so a crash never leaves a half model
    # that a later run would take for a complete one.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp", dir=str(out.parent)))
    try:
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        full_meta = dict(meta)
        full_meta["stats"] = {
            "first_loss": losses[0] if losses else None,
            "final_loss": float(sum(losses[-10:]) / len(losses[-10:])) if losses else None,
            "seconds": round(time.time() - t0, 2),
            "num_parameters": int(sum(p.numel() for p in model.parameters())),
        }
        (tmp / "warmup_stats.json").write_text(json.dumps(full_meta["stats"], indent=2))
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("tiny://quickstart: built %s in %.1fs (warm-up loss %s -> %s)", out, time.time() - t0,
                full_meta["stats"]["first_loss"], full_meta["stats"]["final_loss"])


def _calc_kwargs() -> Dict[str, Any]:
    from .calc import CALC_BUILD

    return dict(CALC_BUILD)


def built_quickstart_model(cache_dir: Union[str, os.PathLike], init: bool = False, calc: bool = False,
                           **build_kwargs: Any) -> Optional[str]:
    """The directory :func:`resolve_model_path` returns for ``tiny://quickstart`` (``init``: for
    ``tiny://quickstart-init``; ``calc``: for ``tiny://calc``) with these ``build_kwargs`` (``None`` values: the
    defaults) when that model is built already; None when it would be built (nothing is built here)."""
    kw = {**QUICKSTART_DEFAULTS, "task": None, **(_calc_kwargs() if calc else {}),
          **{k: v for k, v in build_kwargs.items() if v is not None}}
    if init:
        kw["warmup_steps"] = 0
    out = Path(cache_dir) / ("tiny_quickstart_init" if init else "tiny_calc_model" if calc else "tiny_quickstart_model")
    meta = _meta(kw["seed"], kw["warmup_steps"], kw["warmup_lr"], kw["max_operand"], kw["num_layers"],
                 kw["hidden_size"], kw["batch_size"], kw["vocab_size"], kw["task"], kw["answer_noise"])
    return str(out) if _is_complete(out) and _read_meta(out) == meta else None


def resolve_model_path(path: str, cache_dir: Union[str, os.PathLike], **build_kwargs: Any) -> str:
    """``tiny://quickstart`` -> build or reuse the warmed-up model under
    ``cache_dir/tiny_quickstart_model`` and return that directory; ``tiny://quickstart-init`` -> the same model
    with no warm-up (its initial weights) under ``cache_dir/tiny_quickstart_init``; ``tiny://calc`` -> the same
    architecture warmed up on the calculator tool task (rlhf.quickstart.calc) under ``cache_dir/tiny_calc_model``;
    any other string is returned unchanged. ``build_kwargs`` go to :func:`build_quickstart_model` (e.g.
    ``warmup_steps``, ``warmup_lr``, ``max_operand``, ``seed``; ``warmup_steps`` is 0 for the init); ``None``
    values mean "the default", so config fields can be passed straight through.

    Raises:
        ValueError: another ``tiny://`` name.
    """
    if not isinstance(path, str) or not path.startswith("tiny://"):
        return path
    name = path.rstrip("/")
    if name not in (QUICKSTART_SCHEME, QUICKSTART_INIT_SCHEME, CALC_SCHEME, QUICKSTART_MOE_SCHEME):
        raise ValueError(f"resolve_model_path: unknown tiny model {path!r}; the tiny models are "
                         f"{QUICKSTART_SCHEME!r}, {QUICKSTART_INIT_SCHEME!r}, {CALC_SCHEME!r} and "
                         f"{QUICKSTART_MOE_SCHEME!r}.")
    kwargs = {k: v for k, v in build_kwargs.items() if v is not None}
    if name == CALC_SCHEME:
        return build_quickstart_model(Path(cache_dir) / "tiny_calc_model", **{**_calc_kwargs(), **kwargs})
    if name == QUICKSTART_MOE_SCHEME:
        return build_quickstart_model(Path(cache_dir) / "tiny_quickstart_moe", kind="qwen3_moe", **kwargs)
    if name == QUICKSTART_INIT_SCHEME:
        kwargs["warmup_steps"] = 0
        return build_quickstart_model(Path(cache_dir) / "tiny_quickstart_init", **kwargs)
    return build_quickstart_model(Path(cache_dir) / "tiny_quickstart_model", **kwargs)

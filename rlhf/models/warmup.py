"""``tiny://quickstart``: a tiny Llama built locally and warmed up on the embedded arithmetic task.

The quickstart must run PPO on a CPU with no downloads, and RL needs a policy that is right
*sometimes*: a random model never writes ``#### N`` (reward always 0, no signal) and a fully
trained one is always right (no signal either). :func:`build_quickstart_model` therefore

1. trains the tiny byte-level BPE tokenizer (:func:`rlhf.models.tiny.make_tiny_tokenizer`,
   ChatML template, EOS ``<|im_end|>``, digits split; its default corpus plus the task's words);
2. builds a tiny Llama (2 layers, hidden 64, 4 heads / 2 KV heads, untied, fp32, HF init;
   125k parameters);
3. runs a short supervised warm-up (plain torch, one thread, AdamW, teacher forcing, loss on
   the response tokens only) on the task's worked solutions, each followed by EOS; the prompt
   is rendered exactly as :class:`rlhf.data.rl_dataset.RLDataset` renders it (chat template,
   ``add_generation_prompt=True``, no extra special tokens);
4. saves model + tokenizer + ``generation_config.json`` (EOS / pad / BOS ids only) and a
   ``warmup_meta.json`` recording every argument: a later call with the same arguments
   reuses the directory (idempotent cache; builds are locked against concurrent callers).

How the partial competence is made (``answer_noise``): in 60 % of the warm-up
demonstrations the final ``#### N`` line misreports the (correctly) computed result by
+-1 or +-2 (:func:`corrupt_answers`). The warmed-up model therefore computes the sum well
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

The RL task must be generated with the settings the model was warmed up on: use
:func:`quickstart_task_kwargs` (or read ``warmup_meta.json["task"]``), e.g.
``make_arithmetic_dataset(n, seed=s, **quickstart_task_kwargs(max_operand))``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "QUICKSTART_SCHEME",
    "QUICKSTART_DEFAULTS",
    "QUICKSTART_TASK",
    "quickstart_task_kwargs",
    "build_quickstart_model",
    "resolve_model_path",
    "make_quickstart_tokenizer",
    "encode_example",
    "evaluate_model",
    "corrupt_answers",
    "response_loss",
]

QUICKSTART_SCHEME = "tiny://quickstart"
META_FILE = "warmup_meta.json"
_META_VERSION = 2  # 2: max_position_embeddings 1024

# Task the quickstart model is warmed up on (and the RL dataset must use): "7+1=" ->
# "7+1=8\n#### 8<|im_end|>" (10-11 response tokens with EOS, so max_response_length 16 fits;
# prompts are ~20 tokens). The word style works too (18-22 response tokens) but is slower.
QUICKSTART_TASK: Dict[str, Any] = {"style": "short", "ops": ("+",), "min_operand": 1}

# Defaults of build_quickstart_model (tuned; see module docstring).
QUICKSTART_DEFAULTS: Dict[str, Any] = {
    "seed": 0,
    "warmup_steps": 300,
    "warmup_lr": 3e-3,
    "max_operand": 9,
    "num_layers": 2,
    "hidden_size": 64,
    "batch_size": 32,
    "vocab_size": 400,
    "answer_noise": 0.6,
}

_WARMUP_DATA_SEED_OFFSET = 7919  # warm-up problems come from their own RNG stream
_NOISE_OFFSETS = (-2, -1, 1, 2)  # how far a corrupted final answer is from the truth


def quickstart_task_kwargs(max_operand: int = QUICKSTART_DEFAULTS["max_operand"],
                           task: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Keyword arguments for :func:`rlhf.data.synthetic.make_arithmetic_dataset` that
    produce the task the quickstart model was warmed up on (``style``, ``ops``,
    ``min_operand``, ``max_operand``)."""
    kw = dict(QUICKSTART_TASK if task is None else task)
    kw["ops"] = tuple(kw["ops"])
    kw["max_operand"] = int(max_operand)
    return kw


# --------------------------------------------------------------------------- tokenizer / encoding


def _task_corpus() -> List[str]:
    """Sentences covering every word of the embedded task (both styles), so BPE merges them."""
    from rlhf.data.synthetic import _ITEMS, _NAMES, make_arithmetic_problem

    out = []
    for i, name in enumerate(_NAMES):
        for j, item in enumerate(_ITEMS):
            a, b = 2 + (i + j) % 7, 1 + (i * 3 + j) % 5
            op = "+-*"[(i + j) % 3]
            q, sol, _ = make_arithmetic_problem(a, b, op, style="word", name=name, item=item)
            out += [q, sol, f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{sol}<|im_end|>"]
    return out


def make_quickstart_tokenizer(vocab_size: int = QUICKSTART_DEFAULTS["vocab_size"]):
    """The quickstart tokenizer: :func:`rlhf.models.tiny.make_tiny_tokenizer` (ChatML
    template, EOS ``<|im_end|>``, pad ``<|pad|>``) trained on the default corpus plus the
    embedded task's sentences."""
    from .tiny import DEFAULT_CORPUS, make_tiny_tokenizer

    return make_tiny_tokenizer(vocab_size=vocab_size, corpus=list(DEFAULT_CORPUS) + _task_corpus())


def _prompt_ids(tokenizer: Any, prompt: Union[str, List[Dict[str, str]]]) -> List[int]:
    """Prompt token ids exactly as RLDataset produces them (chat template if the tokenizer has one)."""
    from rlhf.data.rl_dataset import render_prompt

    use_chat = bool(getattr(tokenizer, "chat_template", None))
    text = render_prompt(tokenizer, prompt, use_chat)
    return list(tokenizer(text, add_special_tokens=not use_chat)["input_ids"])


def encode_example(tokenizer: Any, prompt: Union[str, List[Dict[str, str]]],
                   solution: str) -> Tuple[List[int], List[int]]:
    """``(prompt_ids, response_ids)`` for one supervised example; the response is the
    solution followed by the tokenizer's EOS token, so generation learns to stop."""
    p = _prompt_ids(tokenizer, prompt)
    r = list(tokenizer(solution, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is not None:
        r.append(int(tokenizer.eos_token_id))
    return p, r


def _batch_tensors(examples: Sequence[Tuple[List[int], List[int]]], pad_id: int):
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 outside the response)."""
    L = max(len(p) + len(r) for p, r in examples)
    B = len(examples)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    labels = torch.full((B, L), -100, dtype=torch.long)
    for b, (p, r) in enumerate(examples):
        n = len(p) + len(r)
        ids[b, :n] = torch.tensor(p + r)
        mask[b, :n] = 1
        labels[b, len(p):n] = torch.tensor(r)
    return ids, mask, labels


def response_loss(model: Any, examples: Sequence[Tuple[List[int], List[int]]], pad_id: int) -> torch.Tensor:
    """Mean token cross-entropy on the response tokens (teacher forcing)."""
    ids, mask, labels = _batch_tensors(examples, pad_id)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)


# --------------------------------------------------------------------------- build


def corrupt_answers(rows: Sequence[Dict[str, Any]], fraction: float, seed: int = 0) -> List[Dict[str, Any]]:
    """Copies of ``rows`` where a ``fraction`` of the worked solutions misreport the result
    on their final ``#### N`` line (the true answer plus an offset in {-2, -1, 1, 2}, kept
    >= 0); the worked line (``... = 7 ...``) stays correct. Warm-up only: RL ground truths
    stay correct.

    Why: the warmed-up policy then computes the sum well but copies it to the answer line
    faithfully only part of the time, so its T=1 reward is partial, and the fix (report the
    result you computed) is one behaviour shared by every problem, which policy-gradient
    RL learns within a few dozen updates. (Undertraining alone spreads the errors over
    many tokens and RL barely improves it; corrupting the worked result too makes RL slower.)
    """
    rng = random.Random(seed + 1_000_003)
    out = []
    for r in rows:
        r = dict(r)
        if rng.random() < fraction:
            ans = int(r["ground_truth"])
            wrong = ans + rng.choice([d for d in _NOISE_OFFSETS if ans + d >= 0])
            body, _ = r["solution"].rsplit("#### ", 1)
            r["solution"] = f"{body}#### {wrong}"
        out.append(r)
    return out


def _meta(seed, warmup_steps, warmup_lr, max_operand, num_layers, hidden_size, batch_size, vocab_size,
          task, answer_noise) -> Dict[str, Any]:
    return {
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

    Raises:
        ValueError: negative ``warmup_steps`` or non-positive sizes / lr.
    """
    if warmup_steps < 0 or batch_size < 1 or num_layers < 1 or hidden_size < 8 or not warmup_lr > 0:
        raise ValueError(
            f"build_quickstart_model: invalid settings warmup_steps={warmup_steps}, warmup_lr={warmup_lr}, "
            f"batch_size={batch_size}, num_layers={num_layers}, hidden_size={hidden_size}.")
    out = Path(out_dir)
    meta = _meta(seed, warmup_steps, warmup_lr, max_operand, num_layers, hidden_size, batch_size, vocab_size, task,
                 answer_noise)
    if not force and _is_complete(out) and _read_meta(out) == meta:
        logger.info("tiny://quickstart: reusing the warmed-up model in %s", out)
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Several processes (ranks, actor + critic) may resolve the same path at once: one builds,
    # the others wait on the lock and then reuse. The caller's RNG state is left untouched.
    # The warm-up runs single-threaded: for a model this small threads only add overhead (and
    # thrash on a busy machine), and one thread makes the result independent of the core count.
    with _file_lock(out.parent / f".{out.name}.lock"), torch.random.fork_rng(devices=[]), _num_threads(1):
        if not force and _is_complete(out) and _read_meta(out) == meta:
            logger.info("tiny://quickstart: reusing the warmed-up model in %s (built by another process)", out)
            return str(out)
        _build(out, meta, seed=seed, warmup_steps=warmup_steps, warmup_lr=warmup_lr, max_operand=max_operand,
               num_layers=num_layers, hidden_size=hidden_size, batch_size=batch_size, vocab_size=vocab_size,
               task=task, answer_noise=answer_noise, log_every=log_every)
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
           batch_size, vocab_size, task, answer_noise, log_every) -> None:
    from rlhf.data.synthetic import make_arithmetic_dataset

    from .tiny import IM_END_ID, IM_START_ID, PAD_ID, build_tiny_hf_model

    t0 = time.time()
    tok = make_quickstart_tokenizer(vocab_size)
    assert tok.pad_token_id == PAD_ID and tok.eos_token_id == IM_END_ID
    model = build_tiny_hf_model(
        "llama_gqa", vocab_size=len(tok), hidden_size=hidden_size, num_layers=num_layers, seed=seed,
        init="hf", dtype=torch.float32, bos_token_id=IM_START_ID, eos_token_id=IM_END_ID, pad_token_id=PAD_ID,
        max_position_embeddings=1024)  # room for GSM8K prompts (<= 562 tokens) + responses

    task_kw = quickstart_task_kwargs(max_operand, task)
    rows = make_arithmetic_dataset(max(1, warmup_steps * batch_size), seed=seed + _WARMUP_DATA_SEED_OFFSET,
                                   split="warmup", **task_kw)
    if answer_noise > 0:
        rows = corrupt_answers(rows, answer_noise, seed=seed + _WARMUP_DATA_SEED_OFFSET)
    examples = [encode_example(tok, r["prompt"], r["solution"]) for r in rows]

    losses: List[float] = []
    if warmup_steps > 0:
        g = torch.Generator().manual_seed(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=warmup_lr, betas=(0.9, 0.98), weight_decay=0.0)
        n_warm = max(1, warmup_steps // 10)

        def lr_at(step: int) -> float:
            if step < n_warm:
                return warmup_lr * (step + 1) / n_warm
            frac = (step - n_warm) / max(1, warmup_steps - n_warm)
            return warmup_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

        model.train()
        perm = torch.randperm(len(examples), generator=g).tolist()
        for step in range(warmup_steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            batch = [examples[i] for i in perm[step * batch_size:(step + 1) * batch_size]]
            loss = response_loss(model, batch, PAD_ID)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            if log_every and (step % log_every == 0 or step == warmup_steps - 1):
                logger.info("tiny://quickstart warm-up step %d/%d loss %.4f", step + 1, warmup_steps, losses[-1])
        model.eval()

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


def resolve_model_path(path: str, cache_dir: Union[str, os.PathLike], **build_kwargs: Any) -> str:
    """``tiny://quickstart`` -> build or reuse the warmed-up model under
    ``cache_dir/tiny_quickstart_model`` and return that directory; any other string is
    returned unchanged. ``build_kwargs`` go to :func:`build_quickstart_model` (e.g.
    ``warmup_steps``, ``warmup_lr``, ``max_operand``, ``seed``); ``None`` values mean "the
    default", so config fields can be passed straight through.

    Raises:
        ValueError: another ``tiny://`` name (only ``tiny://quickstart`` exists).
    """
    if not isinstance(path, str) or not path.startswith("tiny://"):
        return path
    if path.rstrip("/") != QUICKSTART_SCHEME:
        raise ValueError(f"resolve_model_path: unknown tiny model {path!r}; the only one is {QUICKSTART_SCHEME!r}.")
    kwargs = {k: v for k, v in build_kwargs.items() if v is not None}
    return build_quickstart_model(Path(cache_dir) / "tiny_quickstart_model", **kwargs)


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate_model(
    model: Any,
    tokenizer: Any,
    rows: Sequence[Dict[str, Any]],
    *,
    temperature: float = 0.0,
    num_samples: int = 1,
    max_new_tokens: int = 32,
    batch_size: int = 64,
    seed: int = 0,
) -> Dict[str, float]:
    """Generate with HF ``generate`` and score with the strict GSM8K scorer.

    Returns ``{"reward": mean score, "format": fraction with a ``#### N`` answer,
    "eos": fraction that stopped with EOS}`` over ``len(rows) * num_samples`` responses
    (greedy when ``temperature == 0``). Sampling is seeded by ``seed``; the caller's RNG
    state is restored afterwards.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _evaluate(model, tokenizer, rows, temperature, num_samples, max_new_tokens, batch_size)


def _evaluate(model, tokenizer, rows, temperature, num_samples, max_new_tokens, batch_size) -> Dict[str, float]:
    from rlhf.rewards.gsm8k import compute_score, extract_solution

    pad = tokenizer.pad_token_id
    eos = tokenizer.eos_token_id
    scores, fmt, stopped = [], [], []
    items = [r for r in rows for _ in range(num_samples)]
    for s in range(0, len(items), batch_size):
        chunk = items[s:s + batch_size]
        prompts = [_prompt_ids(tokenizer, r["prompt"]) for r in chunk]
        L = max(len(p) for p in prompts)
        ids = torch.full((len(chunk), L), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, p in enumerate(prompts):
            ids[b, L - len(p):] = torch.tensor(p)
            mask[b, L - len(p):] = 1
        if temperature > 0:
            gen_kw = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
        else:
            gen_kw = dict(do_sample=False)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, eos_token_id=eos,
                             pad_token_id=pad, **gen_kw)[:, L:]
        for b, r in enumerate(chunk):
            toks = out[b].tolist()
            stop = eos in toks
            if stop:
                toks = toks[:toks.index(eos)]
            text = tokenizer.decode(toks, skip_special_tokens=True)
            scores.append(compute_score(text, r["ground_truth"]))
            fmt.append(extract_solution(text) is not None)
            stopped.append(stop)
    n = max(1, len(scores))
    return {"reward": sum(scores) / n, "format": sum(fmt) / n, "eos": sum(stopped) / n}

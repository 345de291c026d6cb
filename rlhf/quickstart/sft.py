"""The quickstart model's supervised warm-up: teacher forcing on worked solutions, loss on the
response tokens only, plus the answer corruption that makes the warmed-up policy right only
part of the time (see :mod:`rlhf.quickstart.model` for why)."""

from __future__ import annotations

import logging
import math
import random
from typing import Any, Dict, List, Sequence, Tuple

import torch

from rlhf.data.collate import pad_sequences

__all__ = ["corrupt_answers", "batch_tensors", "response_loss", "sft_warmup"]

logger = logging.getLogger(__name__)

_NOISE_OFFSETS = (-2, -1, 1, 2)  # how far a corrupted final answer is from the truth


def corrupt_answers(rows: Sequence[Dict[str, Any]], fraction: float, seed: int = 0) -> List[Dict[str, Any]]:
    """Copies of ``rows`` where a ``fraction`` of the worked solutions misreport the result
    on their final ``#### N`` line (the boxed style: in its last ``\\boxed{N}``) (the true answer plus an
    offset in {-2, -1, 1, 2}, kept >= 0); the worked line (``... = 7 ...``) stays correct. Warm-up
    only: RL ground truths stay correct.

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
            if "#### " in r["solution"]:
                body, _ = r["solution"].rsplit("#### ", 1)
                r["solution"] = f"{body}#### {wrong}"
            else:  # the boxed style: "... \\boxed{N}."
                body, tail = r["solution"].rsplit(f"\\boxed{{{ans}}}", 1)
                r["solution"] = f"{body}\\boxed{{{wrong}}}{tail}"
        out.append(r)
    return out


def batch_tensors(examples: Sequence[Tuple[List[int], ...]], pad_id: int):
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` [B, L] (-100 outside the response)
    of ``(prompt_ids, response_ids)`` examples; L = the longest prompt + response.  An example
    ``(prompt_ids, response_ids, loss_mask)`` (a multi-turn one) also has -100 where ``loss_mask`` is 0
    (tool / user tokens)."""
    ids, mask = pad_sequences([ex[0] + ex[1] for ex in examples], pad_id, side="right")
    labels, _ = pad_sequences([[-100] * len(ex[0]) + ([t if m else -100 for t, m in zip(ex[1], ex[2])]
                                                      if len(ex) > 2 else list(ex[1])) for ex in examples],
                              -100, side="right")
    return ids, mask, labels


def response_loss(model: Any, examples: Sequence[Tuple[List[int], List[int]]], pad_id: int) -> torch.Tensor:
    """Mean token cross-entropy on the response tokens (teacher forcing)."""
    ids, mask, labels = batch_tensors(examples, pad_id)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)


def sft_warmup(model: Any, examples: Sequence[Tuple[List[int], List[int]]], pad_id: int, *, steps: int,
               lr: float, batch_size: int, seed: int, log_every: int = 0) -> List[float]:
    """Supervised warm-up of ``model`` in place: ``steps`` AdamW steps (betas 0.9 / 0.98, no weight
    decay, gradient norm clipped to 1) on ``batch_size`` examples each, drawn without replacement in
    an order seeded by ``seed``; learning rate linear warm-up over 10 % of the steps to ``lr``, then
    cosine down to ``0.1 * lr``.  Returns the loss of every step (mean response-token cross-entropy).
    """
    losses: List[float] = []
    if steps <= 0:
        return losses
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    n_warm = max(1, steps // 10)

    def lr_at(step: int) -> float:
        if step < n_warm:
            return lr * (step + 1) / n_warm
        frac = (step - n_warm) / max(1, steps - n_warm)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    model.train()
    perm = torch.randperm(len(examples), generator=g).tolist()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        batch = [examples[i] for i in perm[step * batch_size:(step + 1) * batch_size]]
        loss = response_loss(model, batch, pad_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            logger.info("tiny://quickstart warm-up step %d/%d loss %.4f", step + 1, steps, losses[-1])
    model.eval()
    return losses

"""DPO trainer (Rafailov et al. 2023): `algorithm.name=dpo`, dispatched by `rlhf.trainer.run`.

    pairs -> reference log-probs -> DPO loss / actor update -> metrics / validation / checkpoint

Offline preference pairs (``prompt``, ``chosen``, ``rejected``) come from parquet/jsonl files
(``data.train_files`` / ``data.val_files``) or ``embedded://preference`` (the embedded arithmetic
task: the correct worked answer is chosen, a wrong one rejected; ``embedded://arithmetic`` means the
same under DPO).  The actor is the same megatron model, optimizer (``actor.optim``), checkpoints and
TensorBoard as in PPO; the frozen reference is the initial model.  Each step takes
``data.train_batch_size`` pairs, one optimizer step per ``actor.ppo_mini_batch_size`` pairs, with
micro batches of ``actor.ppo_micro_batch_size_per_gpu`` sequences (whole pairs).  Sequence log-probs
are summed over the response tokens.  No rollout engine is started.

Metrics: dpo/loss, dpo/accuracy (implicit reward of chosen > rejected), dpo/margin,
dpo/chosen_rewards, dpo/rejected_rewards, actor/grad_norm; validation: val/preference_accuracy
(implicit reward), val/logp_accuracy (log pi(chosen) > log pi(rejected)), val/dpo_loss.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rlhf.mcore.forward import forward_backward
from rlhf.mcore.optim import optimizer_step, zero_grads
from rlhf.algorithms import compute_dpo_loss
from rlhf.batch import build_rollout_batch, dp_slice
from rlhf.rollout.types import RolloutSample
from rlhf.workers import _dp, _micro, compute_log_probs, gather_metrics

_KEYS = ("input_ids", "attention_mask", "position_ids", "response_mask", "ref_logps")


@dataclass
class DPOSetup:
    cfg: Any
    tokenizer: Any
    hf_config: Any
    actor: Any
    actor_state: Any
    reference: Any
    train_loader: Any
    val_pairs: list
    tracker: Any
    start_step: int = 0
    total_steps: int = 0
    val_ref_logps: Any = None


def load_pairs(files, cfg, split: str) -> list[dict]:
    """Preference rows from files, or generated for embedded://preference (and embedded://arithmetic)."""
    if isinstance(files, str) and files in ("embedded://preference", "embedded://arithmetic"):
        from rlhf.quickstart.arithmetic import make_synthetic_preference_dataset, quickstart_task_kwargs

        n = cfg.data.embedded_num_train if split == "train" else cfg.data.embedded_num_val
        return make_synthetic_preference_dataset(n, seed=cfg.data.seed + (split != "train"),
                                                 **quickstart_task_kwargs(cfg.data.embedded_max_operand))
    from omegaconf import OmegaConf

    from rlhf.data.preference import load_preference_dataset

    files = OmegaConf.to_container(files) if OmegaConf.is_config(files) else files
    return load_preference_dataset(files, cfg.data.max_train_samples if split == "train" else cfg.data.max_val_samples)


def encode_pairs(tokenizer, rows, max_prompt_length: int, max_response_length: int) -> list[dict]:
    """Token ids per pair (responses end with EOS, cut to max_response_length); pairs whose prompt
    is longer than max_prompt_length are dropped."""
    from rlhf.data.preference import encode_preference_pair

    out = []
    for r in rows:
        e = encode_preference_pair(tokenizer, r["prompt"], r["chosen"], r["rejected"])
        if len(e["prompt_ids"]) <= max_prompt_length:
            out.append({k: v[:max_response_length] if k != "prompt_ids" else v for k, v in e.items()})
    if not out:
        raise ValueError(f"no preference pair has a prompt within data.max_prompt_length={max_prompt_length}")
    return out


def pair_batch(pairs: list[dict], pad_id: int, max_response_length: int) -> dict:
    """Rows [chosen_1, rejected_1, chosen_2, ...] in the rollout-batch layout (rlhf/batch.py)."""
    samples = [RolloutSample(p["prompt_ids"], p[k], [0.0] * len(p[k]), "stop", i, 0)
               for i, p in enumerate(pairs) for k in ("chosen_ids", "rejected_ids")]
    return build_rollout_batch(samples, pad_id, max_response_length)


def sequence_log_probs(chunks, batch: dict, vocab_size: int, micro_batch_size: int) -> torch.Tensor:
    """Sum over response tokens of log pi(token), [N] on every rank."""
    lp = compute_log_probs(chunks, batch, vocab_size=vocab_size, temperature=1.0, micro_batch_size=micro_batch_size)
    return (lp["log_probs"] * batch["response_mask"]).sum(1)


def dpo_metrics(logps: torch.Tensor, ref_logps: torch.Tensor, dcfg) -> tuple[torch.Tensor, dict]:
    loss, chosen_r, rejected_r, _ = compute_dpo_loss(logps[0::2], logps[1::2], ref_logps[0::2], ref_logps[1::2],
                                                     dcfg.beta, dcfg.label_smoothing, dcfg.loss_type)
    return loss, {"dpo/loss": loss.detach(), "dpo/accuracy": (chosen_r > rejected_r).float().mean(),
                  "dpo/margin": (chosen_r - rejected_r).mean(), "dpo/chosen_rewards": chosen_r.mean(),
                  "dpo/rejected_rewards": rejected_r.mean()}


def dpo_update(s: DPOSetup, batch: dict) -> dict:
    """One optimizer step per mini batch of pairs; loss = DPO loss of each micro batch's pairs."""
    cfg = s.cfg
    rank, size, _ = _dp()
    n_pairs, mini = batch["input_ids"].shape[0] // 2, cfg.actor.ppo_mini_batch_size
    R = batch["responses"].shape[1]

    def loss_fn(outs, mb):
        logps = (outs["log_probs"][:, -R:] * mb["response_mask"]).sum(1)
        return dpo_metrics(logps, mb["ref_logps"], cfg.algorithm.dpo)

    per_micro, grad_norms = [], []
    for start in range(0, n_pairs, mini):
        rows = torch.arange(2 * start, 2 * min(start + mini, n_pairs))
        mb = {k: dp_slice(batch[k][rows], rank, size) for k in _KEYS}
        pairs_local = mb["input_ids"].shape[0] // 2
        zero_grads(s.actor_state)
        per_micro += forward_backward(
            s.actor_state.model, mb, kind="log_probs", vocab_size=s.actor.spec.vocab_size, temperature=1.0,
            forward_only=False, loss_fn=loss_fn,
            micro_batch_size=2 * _micro(pairs_local, max(1, cfg.actor.ppo_micro_batch_size_per_gpu // 2)))
        grad_norms.append(optimizer_step(s.actor_state)[1])
    m = gather_metrics(per_micro)
    m.update({"actor/grad_norm": float(np.mean(grad_norms)),
              "actor/lr": float(s.actor_state.optimizer.param_groups[0]["lr"])})
    return m


def validate_dpo(s: DPOSetup) -> dict:
    """Preference accuracy of the current actor on the validation pairs."""
    cfg, mbs = s.cfg, s.cfg.actor.log_prob_micro_batch_size_per_gpu
    dp = _dp()[1]
    bs = max(dp, cfg.data.val_batch_size // dp * dp)  # pairs per batch; a multiple of dp, like len(val_pairs)
    logps, refs = [], []
    for i in range(0, len(s.val_pairs), bs):
        batch = pair_batch(s.val_pairs[i:i + bs], s.tokenizer.pad_token_id, cfg.data.max_response_length)
        logps.append(sequence_log_probs(s.actor.chunks, batch, s.actor.spec.vocab_size, mbs))
        if s.val_ref_logps is None:
            refs.append(sequence_log_probs(s.reference.chunks, batch, s.actor.spec.vocab_size, mbs))
    if s.val_ref_logps is None:
        s.val_ref_logps = torch.cat(refs)
    logps = torch.cat(logps)
    _, m = dpo_metrics(logps, s.val_ref_logps, cfg.algorithm.dpo)
    return {"val/preference_accuracy": float(m["dpo/accuracy"]), "val/dpo_loss": float(m["dpo/loss"]),
            "val/margin": float(m["dpo/margin"]),
            "val/logp_accuracy": float((logps[0::2] > logps[1::2]).float().mean())}


def build_dpo(cfg) -> DPOSetup:
    """Collective: distributed state, actor + optimizer, frozen reference, pairs, tracker, resume."""
    from transformers import AutoConfig, AutoTokenizer

    from rlhf.mcore.distributed import init_distributed, init_model_parallel, set_seed
    from rlhf.mcore.models import build_model_chunks
    from rlhf.mcore.optim import build_train_state
    from rlhf.data.loader import StatefulPromptLoader
    from rlhf.setup import _optim, _resolve_model
    from rlhf.tracking import Tracking

    init_distributed()
    p = cfg.parallel
    init_model_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                        p.virtual_pipeline_model_parallel_size)
    set_seed(cfg.trainer.seed)
    dp = _dp()[1]
    for key, v in (("data.train_batch_size", cfg.data.train_batch_size),
                   ("actor.ppo_mini_batch_size", cfg.actor.ppo_mini_batch_size)):
        if v % dp:
            raise ValueError(f"DPO: {key}={v} pairs must be a multiple of the data-parallel size {dp}")
    if cfg.data.train_batch_size % cfg.actor.ppo_mini_batch_size:
        raise ValueError("DPO: actor.ppo_mini_batch_size must divide data.train_batch_size")
    if dist.get_rank() == 0:
        os.makedirs(cfg.trainer.default_local_dir, exist_ok=True)
    model_path = _resolve_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or model_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    hf_config = AutoConfig.from_pretrained(model_path)
    d = cfg.data
    train = encode_pairs(tokenizer, load_pairs(d.train_files, cfg, "train"), d.max_prompt_length, d.max_response_length)
    val = encode_pairs(tokenizer, load_pairs(d.val_files, cfg, "val"), d.max_prompt_length, d.max_response_length)
    val = val[:len(val) // dp * dp]
    loader = StatefulPromptLoader(train, d.train_batch_size, shuffle=d.shuffle, seed=d.seed, drop_last=True,
                                  collate_fn=list)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype]
    common = dict(make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by, params_dtype=dtype,
                  sequence_parallel=p.sequence_parallel, recompute=p.recompute)
    actor = build_model_chunks(hf_config, "actor", model_path, **common)
    actor_state = build_train_state(actor.chunks, actor.config, _optim(cfg.actor.optim))
    reference = build_model_chunks(hf_config, "reference", model_path, **common)
    tracker = Tracking(os.path.join(cfg.trainer.default_local_dir, "tensorboard"), backends=list(cfg.trainer.logger),
                       enabled=dist.get_rank() == 0)
    s = DPOSetup(cfg, tokenizer, hf_config, actor, actor_state, reference, loader, val, tracker,
                 total_steps=cfg.trainer.total_training_steps or len(loader) * cfg.trainer.total_epochs)
    _maybe_resume(s)
    return s


def _maybe_resume(s: DPOSetup) -> None:
    from rlhf.checkpointing import checkpoint_root, latest_checkpoint, load_checkpoint

    t = s.cfg.trainer
    if t.resume_mode == "disable":
        return
    path = t.resume_from_path if t.resume_mode == "resume_path" else latest_checkpoint(checkpoint_root(t.default_local_dir))
    if path:
        state = load_checkpoint(path, {"actor": s.actor_state})
        s.train_loader.load_state_dict(state["train_loader"])
        s.start_step = int(state["step"])
        if dist.get_rank() == 0:
            print(f"resumed from {path} at step {s.start_step}", flush=True)


def run_dpo(cfg) -> dict:
    """Train with DPO; returns the last metrics (see the module docstring)."""
    from rlhf.checkpointing import checkpoint_root, save_checkpoint

    s = build_dpo(cfg)
    t, last = cfg.trainer, {}
    mbs, vocab = cfg.actor.log_prob_micro_batch_size_per_gpu, s.actor.spec.vocab_size
    try:
        if t.val_before_train and s.start_step == 0:
            last = validate_dpo(s)
            s.tracker.log(last, 0)
        for step in range(s.start_step + 1, s.total_steps + 1):
            t0 = time.perf_counter()
            batch = pair_batch(s.train_loader.next_batch(), s.tokenizer.pad_token_id, cfg.data.max_response_length)
            batch["ref_logps"] = sequence_log_probs(s.reference.chunks, batch, vocab, mbs)
            m = dpo_update(s, batch)
            m["timing/step"] = time.perf_counter() - t0
            m["perf/throughput"] = float(batch["attention_mask"].sum()) / m["timing/step"] / dist.get_world_size()
            if t.test_freq > 0 and (step % t.test_freq == 0 or step == s.total_steps):
                m.update(validate_dpo(s))
            s.tracker.log(m, step)
            last = m
            if t.save_freq > 0 and (step % t.save_freq == 0 or step == s.total_steps):
                save_checkpoint(checkpoint_root(t.default_local_dir), step, {"actor": s.actor_state},
                                {"train_loader": s.train_loader.state_dict()}, t.max_ckpt_to_keep)
        if t.export_hf_at_end:
            from rlhf.mcore.convert import save_hf_checkpoint

            save_hf_checkpoint(s.actor.chunks, s.actor.spec, s.hf_config, os.path.join(t.default_local_dir, "hf_export"),
                               tokenizer=s.tokenizer)
    finally:
        s.tracker.close()
    return last

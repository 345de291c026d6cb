"""The PPO trainer: one readable loop.

    generate -> reward -> old/ref log-probs -> values -> advantages -> critic update
    -> actor update -> weight sync -> metrics / validation / checkpoint

Every trainer rank (torchrun or srun, one per device) runs `run(cfg)`.  Megatron work is SPMD over
all ranks; the rollout engines (SGLang, supervised by Ray) and the reward are driven by global rank
0, which broadcasts the generated batch.  Critic-free estimators (GRPO, RLOO, REINFORCE++) build
no critic.  DAPO's dynamic sampling and overlong shaping live in rlhf/dapo.py; `algorithm.name=dpo`
runs rlhf/dpo_trainer.py instead of this loop.
"""
from __future__ import annotations

import dataclasses
import os
import time
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist

from rlhf import algorithms as algos
from rlhf import dapo
from rlhf.batch import build_rollout_batch, outcome_token_scores
from rlhf.setup import TrainerSetup, build_trainer
from rlhf.workers import compute_log_probs, compute_values, update_actor, update_critic


@contextmanager
def timer(metrics: dict, name: str):
    start = time.perf_counter()
    yield
    metrics[f"timing/{name}"] = time.perf_counter() - start


def generate_and_score(s: TrainerSetup, batch: dict, sampling, step_seed: int | None) -> tuple[list, list, dict]:
    """Rank 0 generates and scores (rlhf/rewards/sources.py); every rank receives
    (samples, scores, reward metrics incl. reward/num_fallbacks)."""
    payload = [None]
    if dist.get_rank() == 0:
        if step_seed is not None:
            sampling = dataclasses.replace(sampling, seed=step_seed)
        samples = s.rollout.generate(batch["input_ids_list"], sampling)
        texts = s.tokenizer.batch_decode([x.response_ids for x in samples], skip_special_tokens=True)
        idx = [x.prompt_index for x in samples]
        scores, reward_metrics = s.reward.score(texts, [batch["data_source"][i] for i in idx],
                                                [batch["ground_truth"][i] for i in idx],
                                                extra_infos=[batch["extra_info"][i] for i in idx],
                                                prompts=[batch["raw_prompt"][i] for i in idx])
        payload = [(samples, scores, reward_metrics)]
    dist.broadcast_object_list(payload, src=0)
    return payload[0]


def validate(s: TrainerSetup) -> dict:
    """Greedy (val_kwargs) generation on the validation set; returns {"val/score": mean}."""
    scores = []
    for batch in s.val_batches():
        _, batch_scores, _ = generate_and_score(s, batch, s.val_sampling, None)
        scores += batch_scores
    return {"val/score": float(np.mean(scores)) if scores else 0.0}


def log_prob_temperature(cfg) -> float:
    """Temperature the trainer applies to its logits: the rollout's (SGLang divides logits by it),
    or 1 for greedy rollouts (temperature 0), whose log-probs SGLang reports unscaled."""
    return cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0


def ppo_step(s: TrainerSetup, step: int) -> dict:
    """One PPO iteration on the next batch of prompts; returns the step's metrics."""
    cfg, m = s.cfg, {}
    with timer(m, "gen"):  # one prompt batch; several with DAPO dynamic sampling (rlhf/dapo.py)
        s.rollout_resume()
        samples, scores, rewards, reward_metrics = dapo.generate_batch(s, step, generate_and_score)
        s.rollout_release()
    m.update(reward_metrics)
    batch = build_rollout_batch(samples, s.tokenizer.pad_token_id, cfg.data.max_response_length)
    batch["n"] = cfg.rollout.n
    mask = batch["response_mask"]
    batch["token_level_scores"] = outcome_token_scores(rewards, mask)  # scores + DAPO overlong shaping
    uids = np.array([x.prompt_index for x in samples])  # one uid per prompt group (GRPO / RLOO baselines)

    with timer(m, "old_log_prob"):
        out = compute_log_probs(s.actor.chunks, batch, vocab_size=s.vocab_size, temperature=log_prob_temperature(cfg),
                                micro_batch_size=cfg.actor.log_prob_micro_batch_size_per_gpu, calculate_entropy=False)
        batch["old_log_probs"] = out["log_probs"]
    if s.reference is not None:
        with timer(m, "ref"):
            batch["ref_log_probs"] = compute_log_probs(
                s.reference.chunks, batch, vocab_size=s.vocab_size, temperature=log_prob_temperature(cfg),
                micro_batch_size=cfg.actor.log_prob_micro_batch_size_per_gpu)["log_probs"]
    if s.critic is not None:
        with timer(m, "values"):
            batch["values"] = compute_values(s.critic.chunks, batch,
                                             micro_batch_size=cfg.actor.log_prob_micro_batch_size_per_gpu)

    with timer(m, "adv"):
        if cfg.algorithm.use_kl_in_reward:
            batch["token_level_rewards"], kl_metrics = algos.apply_kl_penalty(
                batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_probs"], mask, s.kl_ctrl,
                cfg.algorithm.kl_penalty)
            m.update(kl_metrics)
        else:
            batch["token_level_rewards"] = batch["token_level_scores"]
        est = cfg.algorithm.adv_estimator
        if est == "gae":
            adv, ret = algos.compute_gae_advantage_return(batch["token_level_rewards"], batch["values"], mask,
                                                          cfg.algorithm.gamma, cfg.algorithm.lam)
        elif est in ("grpo",):
            adv, ret = algos.compute_grpo_outcome_advantage(batch["token_level_rewards"], mask, uids,
                                                            norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo)
        elif est == "reinforce_plus_plus":
            adv, ret = algos.compute_reinforce_plus_plus_outcome_advantage(batch["token_level_rewards"], mask,
                                                                           cfg.algorithm.gamma)
        else:
            adv, ret = algos.get_adv_estimator_fn(est)(batch["token_level_rewards"], mask, uids)
        batch["advantages"], batch["returns"] = adv, ret

    if s.critic is not None:
        with timer(m, "update_critic"):
            m.update(update_critic(s.critic_state, batch, cfg.critic, step=step))
    with timer(m, "update_actor"):
        m.update(update_actor(s.actor_state, batch, cfg.actor, vocab_size=s.vocab_size,
                              temperature=log_prob_temperature(cfg), step=step))
    with timer(m, "sync_weights"):
        s.sync_weights()

    # metrics with verl's names
    scores_t = torch.tensor(scores, dtype=torch.float32)
    lengths = mask.sum(1).float()
    m.update({
        "critic/score/mean": scores_t.mean().item(), "critic/score/max": scores_t.max().item(),
        "critic/score/min": scores_t.min().item(),
        "critic/rewards/mean": batch["token_level_rewards"].sum(1).mean().item(),
        "critic/advantages/mean": algos.masked_mean(adv, mask).item(),
        "critic/returns/mean": algos.masked_mean(ret, mask).item(),
        "response_length/mean": lengths.mean().item(), "response_length/max": lengths.max().item(),
        "response_length/clip_ratio": (lengths >= cfg.data.max_response_length).float().mean().item(),
        "actor/kl": algos.masked_mean(batch["old_log_probs"] - batch["ref_log_probs"], mask).item()
        if s.reference is not None else 0.0,
        "actor/rollout_log_prob_diff": algos.masked_mean((batch["old_log_probs"] - batch["rollout_log_probs"]).abs(),
                                                         mask).item(),
    })
    if s.critic is not None:
        m["critic/values/mean"] = algos.masked_mean(batch["values"], mask).item()
    if not cfg.algorithm.use_kl_in_reward:
        m.setdefault("actor/reward_kl_penalty", 0.0)
    m["_tokens"] = float(batch["attention_mask"].sum())
    return m


def run(cfg) -> dict:
    """Train with `cfg` (the composed Hydra config, see rlhf/config/). Returns the last metrics.
    `algorithm.name=dpo` trains on offline preference pairs instead (rlhf/dpo_trainer.py)."""
    if cfg.algorithm.name == "dpo":
        from rlhf.dpo_trainer import run_dpo

        return run_dpo(cfg)
    dapo.check_config(cfg)
    s = build_trainer(cfg)
    last: dict = {}
    try:
        if cfg.trainer.val_before_train and s.start_step == 0:
            val = validate(s)
            s.tracker.log(val, 0)
            last.update(val)
        progress = s.progress_bar()
        for step in range(s.start_step + 1, s.total_steps + 1):
            if os.environ.get("RLHF_FAIL_AT_STEP") == str(step):  # fault injection for resume tests
                os._exit(17)
            t0 = time.perf_counter()
            metrics = ppo_step(s, step)
            metrics["timing/step"] = time.perf_counter() - t0
            # tokens (prompt + response) processed per second per trainer device
            metrics["perf/throughput"] = metrics.pop("_tokens") / metrics["timing/step"] / dist.get_world_size()
            if cfg.trainer.test_freq > 0 and (step % cfg.trainer.test_freq == 0 or step == s.total_steps):
                metrics.update(validate(s))
            s.tracker.log(metrics, step)
            last = metrics
            if cfg.trainer.save_freq > 0 and (step % cfg.trainer.save_freq == 0 or step == s.total_steps):
                s.save(step)
            if progress is not None:
                progress.update(1)
                progress.set_postfix(score=f"{metrics['critic/score/mean']:.3f}")
        if progress is not None:
            progress.close()
        if cfg.trainer.export_hf_at_end:
            s.export_hf()
    finally:
        s.close()
    return last

"""The PPO trainer: one readable loop (:meth:`PPOTrainer.train_step`).

    generate -> reward -> old/ref log-probs -> values -> advantages -> critic update
    -> actor update -> weight sync -> metrics

The rollout engines (SGLang, supervised by Ray) and the reward are driven by global rank 0, which
broadcasts the generated batch (rlhf.workers.rollout).  Critic-free estimators (GRPO, RLOO,
REINFORCE++) build no critic.  DAPO's dynamic sampling runs only when ``algorithm.filter_groups.enable``
(rlhf.trainer.dynamic_sampling); the loop, checkpoints and export are BaseTrainer's.
"""
from __future__ import annotations

import os

import numpy as np
import torch.distributed as dist

from rlhf import algorithms as algos
from rlhf.data.collate import collate_prompts
from rlhf.data.loader import StatefulPromptLoader
from rlhf.data.build import build_rl_dataset, needs_ground_truth
from rlhf.workers.batch import build_rollout_batch, dp_info, outcome_token_scores
from rlhf.workers.build import build_actor, build_critic, build_reference, resolve_reward_paths
from rlhf.workers.losses import PPOPolicyLoss
from rlhf.workers.rollout import RolloutWorker

from .base import BaseTrainer
from .dynamic_sampling import Round, check_config, dynamic_sampling, overlong_shaping
from .metrics import compute_data_metrics, rollout_metrics, timer
from .val_metrics import generations_table, validation_metrics

__all__ = ["PPOTrainer", "compute_advantages", "log_prob_temperature", "rollout_seed"]


def log_prob_temperature(cfg) -> float:
    """Temperature the trainer applies to its logits: the rollout's (SGLang divides logits by it),
    or 1 for greedy rollouts (temperature 0), whose log-probs SGLang reports unscaled."""
    return cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0


def rollout_seed(seed: int, step: int, round_index: int) -> int:
    """Sampling seed of generation round `round_index` of `step` (distinct per step and round)."""
    return seed * 100_003 + step * 1009 + round_index * 7


def use_critic(cfg) -> bool:
    """``critic.enable``, or (null) a critic exactly when ``algorithm.adv_estimator=gae``."""
    enabled = cfg.critic.enable if cfg.critic.enable is not None else cfg.algorithm.adv_estimator == "gae"
    if enabled and cfg.algorithm.adv_estimator != "gae" and dist.get_rank() == 0:
        print(f"note: critic.enable=true with algorithm.adv_estimator={cfg.algorithm.adv_estimator}: a critic is "
              f"trained but its values are unused (critic.enable=null builds one only for gae)", flush=True)
    return enabled


def compute_advantages(batch: dict, uids: np.ndarray, acfg, kl_ctrl) -> dict:
    """Fill batch["token_level_rewards"] (scores, minus the KL penalty when ``use_kl_in_reward``),
    batch["advantages"] and batch["returns"] ([N, R]) with ``algorithm.adv_estimator`` (rlhf.algorithms:
    GAE, GRPO, REINFORCE++, RLOO, ...); `uids` [N] groups the samples of one prompt.  `acfg` is the
    config's ``algorithm`` section.  Returns the KL-penalty metrics."""
    mask, metrics = batch["response_mask"], {}
    if acfg.use_kl_in_reward:
        batch["token_level_rewards"], metrics = algos.apply_kl_penalty(
            batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_probs"], mask, kl_ctrl, acfg.kl_penalty)
    else:
        batch["token_level_rewards"] = batch["token_level_scores"]
    rewards, est = batch["token_level_rewards"], acfg.adv_estimator
    if est == "gae":
        adv, ret = algos.compute_gae_advantage_return(rewards, batch["values"], mask, acfg.gamma, acfg.lam)
    elif est == "grpo":
        adv, ret = algos.compute_grpo_outcome_advantage(rewards, mask, uids,
                                                        norm_adv_by_std_in_grpo=acfg.norm_adv_by_std_in_grpo)
    elif est == "reinforce_plus_plus":
        adv, ret = algos.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, acfg.gamma)
    else:
        adv, ret = algos.get_adv_estimator_fn(est)(rewards, mask, uids)
    batch["advantages"], batch["returns"] = adv, ret
    return metrics


class PPOTrainer(BaseTrainer):
    """PPO and its critic-free variants (``algorithm.adv_estimator``), DAPO when configured."""

    progress_desc = "PPO"
    progress_postfix = ("score", "critic/score/mean")

    def __init__(self, cfg):
        check_config(cfg)  # DAPO settings, before anything is built
        super().__init__(cfg)
        d, rank0 = cfg.data, dist.get_rank() == 0
        cache, gt = os.path.join(cfg.trainer.default_local_dir, "data"), needs_ground_truth(cfg.reward)
        train = build_rl_dataset(d, "train", self.data_files("train"), self.tokenizer, cache, require_ground_truth=gt)
        self.val_dataset = build_rl_dataset(d, "val", self.data_files("val"), self.tokenizer, cache,
                                            require_ground_truth=gt)
        self.train_loader = StatefulPromptLoader(train, d.train_batch_size, shuffle=d.shuffle, seed=d.seed,
                                                 drop_last=True, collate_fn=collate_prompts)
        self.total_steps = self.steps_for(self.train_loader)
        temperature = log_prob_temperature(cfg)
        self.actor = build_actor(cfg, self.hf_config, self.model_path, temperature=temperature)
        need_ref = cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss
        self.reference = build_reference(cfg, self.hf_config, self.model_path, temperature=temperature) \
            if need_ref else None
        self.critic = build_critic(cfg, self.model_path) if use_critic(cfg) else None
        self.rollout = RolloutWorker(cfg, self.model_path, self.actor.bundle, self.tokenizer)
        kc = cfg.algorithm.kl_ctrl
        self.kl_ctrl = algos.get_kl_controller(kc.type, kc.kl_coef, kc.target_kl, kc.horizon)
        self.reward = None
        reward_cfg = resolve_reward_paths(cfg)  # collective: reward-model references resolved like the actor's
        if rank0:  # rule / custom / reward-model sources (rlhf/rewards/manager.py) run on rank 0
            from rlhf.rewards.manager import build_reward_manager

            self.reward = build_reward_manager(reward_cfg)
        self.policy_loss = PPOPolicyLoss(cfg.actor)

    def generate_round(self, step: int, round_index: int) -> Round:
        """Draw the next prompt batch, generate ``rollout.n`` responses each, score them and shape the rewards
        (DAPO overlong buffer, when enabled); every rank gets (samples, scores, rewards, metrics)."""
        prompts = self.train_loader.next_batch()
        seed = rollout_seed(self.cfg.trainer.seed, step, round_index)
        samples, scores, reward_metrics = self.rollout.generate(prompts, self.rollout.train_sampling, self.reward,
                                                                seed=seed)
        rewards, shaping = overlong_shaping(samples, scores, self.cfg)
        return samples, scores, rewards, {**reward_metrics, **shaping}

    def train_step(self, step: int) -> dict:
        """One PPO iteration on the next batch of prompts; returns the step's metrics."""
        cfg, m = self.cfg, {}
        with timer(m, "gen"), self.rollout.serving():
            if cfg.algorithm.filter_groups.enable:  # DAPO: several prompt batches until enough groups vary
                samples, scores, rewards, gen_metrics = dynamic_sampling(
                    lambda i: self.generate_round(step, i), cfg, dp_size=dp_info()[1],
                    has_critic=self.critic is not None)
            else:
                samples, scores, rewards, gen_metrics = self.generate_round(step, 0)
        m.update(gen_metrics)
        batch = build_rollout_batch(samples, self.tokenizer.pad_token_id, cfg.data.max_response_length)
        batch["n"] = cfg.rollout.n
        batch["token_level_scores"] = outcome_token_scores(rewards, batch["response_mask"])
        uids = np.array([x.prompt_index for x in samples])  # one uid per prompt group (GRPO / RLOO baselines)

        with timer(m, "old_log_prob"):
            batch["old_log_probs"] = self.actor.compute_log_prob(batch)["log_probs"]
        if self.reference is not None:
            with timer(m, "ref"):
                batch["ref_log_probs"] = self.reference.compute_log_prob(batch)["log_probs"]
        if self.critic is not None:
            with timer(m, "values"):
                batch["values"] = self.critic.compute_values(batch)
        with timer(m, "adv"):
            m.update(compute_advantages(batch, uids, cfg.algorithm, self.kl_ctrl))
        if self.critic is not None:
            with timer(m, "update_critic"):
                m.update(self.critic.update_critic(batch, step=step))
        if step > cfg.trainer.critic_warmup:  # the first critic_warmup steps train only the critic
            with timer(m, "update_actor"):
                m.update(self.actor.update_policy(batch, self.policy_loss, step=step))
            with timer(m, "sync_weights"):  # (an actor that did not change needs no sync)
                self.rollout.sync_weights()

        m.update(compute_data_metrics(batch, scores, cfg.data.max_response_length))
        m.update(rollout_metrics(batch, scores, m["timing/gen"]))
        if not cfg.algorithm.use_kl_in_reward:
            m.setdefault("actor/reward_kl_penalty", 0.0)
        m["_tokens"] = float(batch["attention_mask"].sum())
        return m

    def validate(self) -> dict:
        """Generation with ``rollout.val_kwargs`` on the validation set, in order: ``val/score``, per data source
        ``val/<data_source>/score`` (and pass@k, best@n when ``val_kwargs.n > 1``), and the first
        ``trainer.log_val_generations`` responses as the ``val/generations`` table (rlhf.trainer.val_metrics)."""
        n, show = len(self.val_dataset), self.cfg.trainer.log_val_generations
        loader = StatefulPromptLoader(self.val_dataset, min(self.cfg.data.val_batch_size, n), shuffle=False,
                                      drop_last=False, collate_fn=collate_prompts)
        sources, prompt_ids, scores, rows = [], [], [], []
        for batch in loader:
            samples, batch_scores, _ = self.rollout.generate(batch, self.rollout.val_sampling, self.reward)
            for x, score in zip(samples, batch_scores):
                sources.append(batch["data_source"][x.prompt_index])
                prompt_ids.append(batch["index"][x.prompt_index])
                scores.append(score)
                if len(rows) < show:
                    decode = self.tokenizer.decode
                    rows.append([sources[-1], decode(x.prompt_ids, skip_special_tokens=True),
                                 decode(x.response_ids, skip_special_tokens=True), float(score)])
        metrics = validation_metrics(sources, prompt_ids, scores, self.cfg.rollout.val_kwargs.n)
        if rows:
            metrics["val/generations"] = generations_table(rows)
        return metrics

    # ---- checkpoint contents and shutdown ---------------------------------------------------------
    def checkpoint_roles(self) -> dict:
        roles = super().checkpoint_roles()
        if self.critic is not None:
            roles["critic"] = self.critic.state
        return roles

    def trainer_state(self) -> dict:
        return {**super().trainer_state(), "kl_ctrl": self.kl_ctrl.state_dict()}

    def load_trainer_state(self, state: dict) -> None:
        super().load_trainer_state(state)
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.rollout.sync_weights()  # engines start from the HF weights; give them the resumed actor

    def close(self) -> None:
        super().close()
        if self.reward is not None:
            self.reward.close()
        self.rollout.close()

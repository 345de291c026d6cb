"""The PPO trainer: one readable loop (:meth:`PPOTrainer.train_step`).

    generate -> reward -> old/ref log-probs -> values -> advantages -> critic update
    -> actor update -> weight sync -> metrics

The rollout engines (SGLang, supervised by Ray) and the reward are driven by global rank 0, which
broadcasts the generated batch (rlhf.workers.rollout).  Critic-free estimators (GRPO, RLOO,
REINFORCE++) build no critic.  DAPO's dynamic sampling runs only when ``algorithm.filter_groups.enable``
(rlhf.trainer.dynamic_sampling); the loop, checkpoints and export are BaseTrainer's.  Which samples count
(unscorable rewards: rlhf.rewards.validity; overlong filtering) and the advantages through the estimator
registry are rlhf.trainer.advantages, ReMax's greedy baselines rlhf.trainer.remax; the policy loss is
``actor.policy_loss.loss_mode`` from the registry (rlhf.workers.losses).  On-policy distillation
(``distill.enable``): a teacher scores the student's tokens, the reverse KL enters the advantages (rlhf.trainer.distill).
"""
from __future__ import annotations

import contextlib
import os

import logging

import numpy as np
import torch
import torch.distributed as dist

from rlhf import algorithms as algos
from rlhf.data.collate import collate_prompts
from rlhf.data.loader import StatefulPromptLoader
from rlhf.data.build import build_rl_dataset, needs_ground_truth
from rlhf.rewards.manager import check_reward_config
from rlhf.rewards.validity import ValidityReward, attach_reward_validity
from rlhf.rollout.sampling import check_sampling
from rlhf.workers.batch import (
    build_rollout_batch,
    check_micro_batch_layout,
    dp_info,
    outcome_token_scores,
    pipeline_micro_batch_multiple,
)
from rlhf.workers.build import build_actor, build_critic, build_reference, resolve_reward_paths
from rlhf.workers.losses import PPOPolicyLoss
from rlhf.workers.rollout import RolloutWorker
from rlhf.workers.teacher import build_teacher, resolve_teacher
from rlhf.workers.worker import padding_metrics

from .advantages import apply_rollout_correction, compute_advantages, mismatch_metrics, sample_masks
from .base import BaseTrainer
from .distill import apply_distillation
from .dynamic_sampling import Round, check_config, dynamic_sampling, overlong_shaping
from .fully_async import FullyAsync
from .one_step_off import OneStepOff
from .metrics import compute_data_metrics, compute_timing_metrics, rollout_metrics, timer
from .perf import PerfMeter
from .remax import attach_remax_baselines, greedy_sampling
from .val_metrics import generations_table, validation_metrics

# compute_advantages lives in rlhf.trainer.advantages; re-exported here where it was
log = logging.getLogger(__name__)

__all__ = ["PPOTrainer", "compute_advantages", "log_prob_temperature", "rollout_seed", "algorithm_label"]


def log_prob_temperature(cfg) -> float:
    """Temperature the trainer applies to its logits: the rollout's (SGLang divides logits by it),
    or 1 for greedy rollouts (temperature 0), whose log-probs SGLang reports unscaled."""
    return cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0


def rollout_seed(seed: int, step: int, round_index: int) -> int:
    """Sampling seed of generation round `round_index` of `step` (distinct per step and round)."""
    return seed * 100_003 + step * 1009 + round_index * 7


def algorithm_label(cfg) -> str:
    """The algorithm's name for the progress bar: DAPO (``algorithm.filter_groups.enable``), PPO (gae), else the
    estimator in capitals (GRPO, RLOO, REINFORCE_PLUS_PLUS, ...)."""
    if cfg.algorithm.filter_groups.enable:
        return "DAPO"
    est = str(cfg.algorithm.adv_estimator)
    return "PPO" if est == "gae" else est.upper()


def critic_enabled(cfg) -> bool:
    """``critic.enable``, or (null) a critic exactly when ``algorithm.adv_estimator=gae``."""
    return cfg.critic.enable if cfg.critic.enable is not None else cfg.algorithm.adv_estimator == "gae"


def use_critic(cfg) -> bool:
    """:func:`critic_enabled`, with a note when a critic is trained whose values are unused."""
    enabled = critic_enabled(cfg)
    if enabled and cfg.algorithm.adv_estimator != "gae" and dist.get_rank() == 0:
        log.warning("critic.enable=true with algorithm.adv_estimator=%s: a critic is trained but its values are "
                       "unused (critic.enable=null builds one only for gae)", cfg.algorithm.adv_estimator)
    return enabled


class PPOTrainer(BaseTrainer):
    """PPO and its critic-free variants (``algorithm.adv_estimator``), DAPO when configured."""

    progress_postfix = ("score", "critic/score/mean")
    teacher = None  # on-policy distillation's teacher (rlhf.workers.teacher), built in __init__ with distill.enable
    # rlhf.trainer.one_step_off.OneStepOff (trainer.one_step_off_policy.enable) or rlhf.trainer.fully_async.FullyAsync
    # (async_training.enable): the generation runs beside the training
    off_policy = None

    def check_layout(self) -> None:
        """Virtual pipeline stages: every batch the actor / critic forward or train on splits into a multiple of
        PP micro batches per data-parallel rank; else ValueError with the fix."""
        cfg, n = self.cfg, self.cfg.rollout.n
        rows = {"data.train_batch_size x rollout.n": cfg.data.train_batch_size * n,
                "actor.ppo_mini_batch_size x rollout.n": cfg.actor.ppo_mini_batch_size * n}
        if critic_enabled(cfg):
            rows["critic.ppo_mini_batch_size x rollout.n"] = cfg.critic.ppo_mini_batch_size * n
        check_micro_batch_layout(rows, dp_info()[1], pipeline_micro_batch_multiple())

    def __init__(self, cfg, engines=None):
        """``engines``: rank 0's rollout engines when ``RolloutWorker.launch`` started them before (rlhf.trainer.run);
        else they are launched here, once the model path is known (or after the models, on colocated GPUs)."""
        check_config(cfg)  # DAPO settings, before anything is built
        check_sampling(cfg)  # no top-p / top-k truncation in training rollouts
        check_reward_config(cfg.reward)  # custom reward files import (ImportError naming the file), before any model
        super().__init__(cfg)
        # on-policy distillation: the teacher's tokenizer checked against the student's before any model is built
        teacher_src = resolve_teacher(cfg, self.tokenizer) if cfg.distill.enable else None
        if engines is None:  # CPU / own GPUs: the engines start while the models build
            engines = RolloutWorker.launch(cfg, self.model_path)
        self.progress_desc = algorithm_label(cfg)
        d, rank0 = cfg.data, dist.get_rank() == 0
        cache, gt = os.path.join(cfg.trainer.default_local_dir, "data"), needs_ground_truth(cfg.reward)
        train = build_rl_dataset(d, "train", self.data_files("train"), self.tokenizer, cache, require_ground_truth=gt)
        self.val_dataset = build_rl_dataset(d, "val", self.data_files("val"), self.tokenizer, cache,
                                            require_ground_truth=gt)
        self.train_loader = StatefulPromptLoader(train, d.train_batch_size, shuffle=d.shuffle, seed=d.seed,
                                                 drop_last=True, collate_fn=collate_prompts)
        self.total_steps = self.steps_for(self.train_loader)
        step_batch = None  # fully async: each step trains require_batches x ppo_mini_batch_size prompts
        if cfg.async_training.enable:
            step_batch = cfg.async_training.require_batches * cfg.actor.ppo_mini_batch_size
            self.total_steps = cfg.trainer.total_training_steps or len(train) // step_batch * cfg.trainer.total_epochs
        self.fill_lr_decay_steps("actor", self.total_steps - cfg.trainer.critic_warmup, cfg.actor.ppo_epochs,
                                 step_batch)
        if critic_enabled(cfg):
            self.fill_lr_decay_steps("critic", self.total_steps, cfg.critic.ppo_epochs, step_batch)
        temperature = log_prob_temperature(cfg)
        self.actor = build_actor(cfg, self.hf_config, self.model_path, temperature=temperature)
        need_ref = cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss
        self.reference = build_reference(cfg, self.hf_config, self.model_path, temperature=temperature,
                                         actor=self.actor) \
            if need_ref else None
        self.critic = build_critic(cfg, self.model_path) if use_critic(cfg) else None
        self.teacher = build_teacher(cfg, *teacher_src, temperature=temperature) if teacher_src else None
        self.rollout = RolloutWorker(cfg, self.model_path, self.actor.bundle, self.tokenizer, manager=engines)
        self.rollout.actor_resident = lambda: self.actor.resident("params")  # offloaded parameters, for each sync
        self.kl_ctrl = algos.get_kl_controller(cfg.algorithm.kl_ctrl)
        self.reward = None
        reward_cfg = resolve_reward_paths(cfg)  # collective: reward-model references resolved like the actor's
        if rank0:  # rule / custom / reward-model sources (rlhf/rewards/manager.py) run on rank 0
            from rlhf.rewards.manager import build_reward_manager

            self.reward = build_reward_manager(reward_cfg)
            fg = cfg.algorithm.filter_groups
            acc = bool(fg.enable and fg.metric == "acc")  # DAPO keeps groups whose reward "acc" varies
            if cfg.reward.exclude_unscorable or acc:  # per-sample validity flags / acc travel with the metrics
                self.reward = ValidityReward(self.reward, valid=cfg.reward.exclude_unscorable, acc=acc)
        self.policy_loss = PPOPolicyLoss(cfg.actor, rollout_correction=cfg.algorithm.rollout_correction)
        specs = {"actor": self.actor.bundle.spec, **({"critic": self.critic.bundle.spec} if self.critic else {})}
        self.perf = PerfMeter(specs, self.actor.device, dist.get_world_size(),
                              {"actor": cfg.actor.ppo_epochs, "critic": cfg.critic.ppo_epochs})  # perf/mfu/*, memory
        pipeline = OneStepOff if cfg.trainer.one_step_off_policy.enable else FullyAsync \
            if cfg.async_training.enable else None
        self.off_policy = pipeline(
            cfg, self.rollout, self.train_loader, lambda step, prompts, started: self.generate_round(
                step, 0, prompts=prompts, started=started),
            lambda step: rollout_seed(cfg.trainer.seed, step, 0), self.total_steps) if pipeline else None

    def generate_round(self, step: int, round_index: int, prompts=None, started=None) -> Round:
        """Draw the next prompt batch (or take `prompts`, whose generation `started` already: one step off-policy),
        generate ``rollout.n`` responses each, score them and shape the rewards (DAPO overlong buffer, when
        enabled); every rank gets (samples, scores, rewards, metrics)."""
        if prompts is None:
            prompts = self.train_loader.next_batch()
        seed = rollout_seed(self.cfg.trainer.seed, step, round_index)
        more = {} if started is None else {"started": started}  # (the synchronous call as before)
        samples, scores, reward_metrics = self.rollout.generate(prompts, self.rollout.train_sampling, self.reward,
                                                                seed=seed, **more)
        attach_reward_validity(samples, reward_metrics)  # -> sample.extra, before the metrics are summed
        if self.cfg.algorithm.adv_estimator == "remax":  # the baseline: one greedy response per prompt
            greedy = self.rollout.generate(prompts, greedy_sampling(self.rollout.train_sampling), self.reward)
            reward_metrics.update(attach_remax_baselines(samples, greedy, self.cfg))
            if "timing_s/reward" in greedy[2]:  # the baseline's scoring is reward time too
                reward_metrics["timing_s/reward"] = reward_metrics.get("timing_s/reward", 0.0) \
                    + greedy[2]["timing_s/reward"]
        rewards, shaping = overlong_shaping(samples, scores, self.cfg)
        return samples, scores, rewards, {**reward_metrics, **shaping}

    def train_step(self, step: int) -> dict:
        """One PPO iteration on the next batch of prompts; returns the step's metrics."""
        cfg, m = self.cfg, {}
        if self.off_policy is not None:  # generated beside the training (rlhf.trainer.one_step_off, fully_async)
            samples, scores, rewards, gen_metrics = self.off_policy.next_round(step)  # with timing_s/gen
        else:
            samples, scores, rewards, gen_metrics = self.generate_step(step, m)
        m.update(gen_metrics)
        # verl times the reward apart from the generation: timing_s/gen is the generation alone
        m["timing_s/gen"] = max(m["timing_s/gen"] - m.get("timing_s/reward", 0.0), 0.0)
        batch = build_rollout_batch(samples, self.tokenizer.pad_token_id, cfg.data.max_response_length)
        if self.off_policy is not None:  # the weight version each sample was generated from
            batch["weight_version"] = torch.tensor([s.extra["weight_version"] for s in samples])
        batch["n"] = cfg.rollout.n
        batch["token_level_scores"] = outcome_token_scores(rewards, batch["response_mask"])
        m.update(sample_masks(batch, samples, cfg))  # sample_valid, loss_mask (, reward_baselines)
        uids = np.array([x.prompt_index for x in samples])  # one uid per prompt group (GRPO / RLOO baselines)

        a = cfg.async_training  # verl's fully-async use_rollout_log_probs: the engine's log-probs are old_log_probs
        if cfg.algorithm.rollout_correction.bypass_mode or (
                a.enable and a.use_rollout_log_probs and not a.compute_prox_log_prob):  # (verl's apply_bypass_mode)
            batch["old_log_probs"] = batch["rollout_log_probs"]
        else:
            with timer(m, "old_log_prob"):
                out = self.actor.compute_log_prob(batch)
                batch["old_log_probs"] = out["log_probs"]
                if "routed_experts" in out:  # MoE routing replay R2: the update replays this forward's routing
                    batch["routed_experts"] = out["routed_experts"]
                m.update(out.get("metrics", {}))  # moe/routing_agreement
            m.update(mismatch_metrics(batch))  # training/rollout_probs_diff_*, verl's calculate_debug_metrics
        if self.reference is not None:
            with timer(m, "ref"):
                batch["ref_log_probs"] = self.reference.compute_log_prob(batch)["log_probs"]
        if self.teacher is not None:  # on-policy distillation: the teacher scores the student's sampled tokens
            with timer(m, "teacher"):
                batch["teacher_log_probs"] = self.teacher.compute_log_prob(batch)["log_probs"]
        if self.critic is not None:
            with timer(m, "values"):
                batch["values"] = self.critic.compute_values(batch)
        # a reward outage can leave no scorable sample: no baseline, no loss, nothing to learn from this batch
        no_signal = not bool(batch["sample_valid"].any())
        m["training/no_scorable_samples"] = float(no_signal)
        if no_signal:
            log.warning("step %d: no sample of the batch could be scored (reward/num_unscorable=%d): actor and "
                        "critic updates skipped", step, len(samples))
            batch["token_level_rewards"] = batch["token_level_scores"]
            batch["advantages"] = batch["returns"] = torch.zeros_like(batch["token_level_scores"])
        else:
            with timer(m, "adv"):
                m.update(apply_rollout_correction(batch, cfg.algorithm.rollout_correction))  # rollout_corr/*
                m.update(compute_advantages(batch, uids, cfg.algorithm, self.kl_ctrl))
        if self.teacher is not None:  # A - distill.kl_coef x (student - teacher log-prob), distill/* metrics
            m.update(apply_distillation(batch, cfg.distill, train=not no_signal))
        if self.critic is not None and not no_signal:
            with timer(m, "update_critic"):
                m.update(self.critic.update_critic(batch, step=step))
        if step > cfg.trainer.critic_warmup and not no_signal:  # the first critic_warmup steps train only the critic
            with timer(m, "update_actor"):
                m.update(self.actor.update_policy(batch, self.policy_loss, step=step))
            if self.off_policy is not None:  # synced when the pipeline says (a batch may be generating now)
                self.off_policy.actor_updated(m)
            else:
                with timer(m, "update_weights"):  # verl's name for the weight sync into the engines
                    m.update(self.rollout.sync_weights().metrics())  # weight_sync/bytes, weight_sync/buckets, ...
        # else the actor did not change; colocated engines that released their weights in serving() get them back
        # from the next generation's RolloutWorker.ensure_resident (the next step's serving(), or validate())

        # critic/score/*: the sequence's token_level_scores, DAPO's overlong penalty included (verl's DAPO reward
        # manager folds it into the score); the raw scores stay in the reward's own metrics
        m.update(compute_data_metrics(batch, cfg.data.max_response_length, cfg.data.max_prompt_length))
        m.update(compute_timing_metrics(m, batch))  # timing_per_token_ms/*
        m.update(rollout_metrics(batch, m["timing_s/gen"]))
        m.update(self.perf.mfu(m, batch))  # perf/mfu/actor, perf/mfu/critic
        m.update(self.perf.memory(m))  # perf/max_memory_allocated_gb
        if not cfg.algorithm.use_kl_in_reward:
            m.setdefault("actor/reward_kl_penalty", 0.0)
        m.update(padding_metrics([self.actor, self.reference, self.critic, self.teacher]))  # perf/padding_efficiency
        m["_tokens"] = float(batch["attention_mask"].sum())
        return m

    def generate_step(self, step: int, m: dict) -> Round:
        """The synchronous generation of step `step` (DAPO's rounds when enabled), timed into `m`."""
        cfg = self.cfg
        with timer(m, "gen"), self.rollout.serving():
            if cfg.algorithm.filter_groups.enable:  # DAPO: several prompt batches until enough groups vary
                return dynamic_sampling(lambda i: self.generate_round(step, i), cfg, dp_size=dp_info()[1],
                                        has_critic=self.critic is not None)
            return self.generate_round(step, 0)

    def validate(self) -> dict:
        """Generation with ``rollout.val_kwargs`` on the validation set, in order: ``val/score``, per data source
        ``val/<data_source>/score`` (and pass@k, best@n when ``val_kwargs.n > 1``), and the first
        ``trainer.log_val_generations`` responses as the ``val/generations`` table (rlhf.trainer.val_metrics)."""
        n, show = len(self.val_dataset), self.cfg.trainer.log_val_generations
        if self.off_policy is not None:  # the batch in flight done, the current actor in the engines
            self.off_policy.quiesce()
        self.rollout.ensure_resident()  # engines hold the actor's weights (a step without sync left them released)
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
    def save_context(self):
        """Colocated engines released around a checkpoint save, resident again after it
        (:meth:`rlhf.workers.rollout.RolloutWorker.released`): the save's distributed-optimizer gather gets the
        memory of their weights and KV cache (the memory plan's "checkpoint save" phase).  Not under one-step
        off-policy: a batch is generating during the save, and engines keep their memory in that mode."""
        if self.off_policy is not None:
            return contextlib.nullcontext()
        return self.rollout.released()

    def checkpoint_roles(self) -> dict:
        roles = super().checkpoint_roles()
        if self.critic is not None:
            roles["critic"] = self.critic.state
        return roles

    def trainer_state(self) -> dict:
        state = {**super().trainer_state(), "kl_ctrl": self.kl_ctrl.state_dict()}
        if self.off_policy is not None:  # the batches in flight are not saved: their prompts are generated again
            key = "one_step_off" if isinstance(self.off_policy, OneStepOff) else "fully_async"
            loader_state, own = self.off_policy.checkpoint_state()
            state.update(train_loader=loader_state, **{key: own})
        return state

    def load_trainer_state(self, state: dict) -> None:
        super().load_trainer_state(state)
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.rollout.sync_weights()  # engines start from the HF weights; give them the resumed actor
        if self.off_policy is not None:
            key = "one_step_off" if isinstance(self.off_policy, OneStepOff) else "fully_async"
            self.off_policy.load_state_dict(state.get(key))

    def close(self, finished: bool = False) -> None:
        if isinstance(self.off_policy, FullyAsync):  # its rollouter thread, before the engines stop
            self.off_policy.close()
        super().close(finished)
        if self.reward is not None:
            self.reward.close()
        self.rollout.close(finished)

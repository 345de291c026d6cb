"""DPO trainer (Rafailov et al. 2023): ``algorithm.name=dpo``, dispatched by ``rlhf.trainer.run``.

    pairs -> reference log-probs -> DPO loss / actor update -> metrics / validation / checkpoint

Offline preference pairs (``prompt``, ``chosen``, ``rejected``) come from parquet/jsonl files
(``data.train_files`` / ``data.val_files``) or ``embedded://preference`` (the embedded arithmetic
task: the correct worked answer is chosen, a wrong one rejected; ``embedded://arithmetic`` means the
same under DPO).  The actor is the same megatron model, optimizer (``actor.optim``), checkpoints and
TensorBoard as in PPO; the frozen reference is the initial model.  Each step takes
``data.train_batch_size`` pairs, one optimizer step per ``actor.ppo_mini_batch_size`` pairs, with
micro batches of ``actor.ppo_micro_batch_size_per_gpu`` sequences (whole pairs); the loss is the mean
over the mini batch's pairs however they are split into micro batches and data-parallel ranks
(rlhf.workers.losses.DPOLoss).  Sequence log-probs are summed over the response tokens (IPO averages
them per token with the response lengths).  No rollout engine is started.

Metrics: dpo/loss, dpo/accuracy (implicit reward of chosen > rejected), dpo/margin,
dpo/chosen_rewards, dpo/rejected_rewards, actor/grad_norm; validation: val/preference_accuracy
(implicit reward), val/logp_accuracy (log pi(chosen) > log pi(rejected)), val/dpo_loss.
"""
from __future__ import annotations

import torch

from rlhf.data.loader import StatefulPromptLoader
from rlhf.data.preference import encode_preference_pairs, load_preference_dataset
from rlhf.workers.batch import build_pair_batch, check_micro_batch_layout, dp_info, pipeline_micro_batch_multiple
from rlhf.workers.build import build_actor, build_reference
from rlhf.workers.losses import DPOLoss, dpo_loss_and_metrics
from rlhf.workers.worker import padding_metrics

from .base import BaseTrainer

__all__ = ["DPOTrainer", "sequence_log_probs"]


def sequence_log_probs(model, batch: dict) -> torch.Tensor:
    """Sum over response tokens of log pi(token), [N] on every rank (`model`: a MegatronActor)."""
    return (model.compute_log_prob(batch)["log_probs"] * batch["response_mask"]).sum(1)


class DPOTrainer(BaseTrainer):
    """Actor + frozen reference on preference pairs (see the module docstring)."""

    progress_desc = "DPO"
    progress_postfix = ("loss", "dpo/loss")

    def check_layout(self) -> None:
        cfg, dp = self.cfg, dp_info()[1]
        for key, v in (("data.train_batch_size", cfg.data.train_batch_size),
                       ("actor.ppo_mini_batch_size", cfg.actor.ppo_mini_batch_size)):
            if v % dp:
                raise ValueError(f"DPO: {key}={v} pairs must be a multiple of the data-parallel size {dp}")
        if cfg.data.train_batch_size % cfg.actor.ppo_mini_batch_size:
            raise ValueError("DPO: actor.ppo_mini_batch_size must divide data.train_batch_size")
        check_micro_batch_layout({"actor.ppo_mini_batch_size pairs x 2": 2 * cfg.actor.ppo_mini_batch_size}, dp,
                                 pipeline_micro_batch_multiple(), group=2)

    def __init__(self, cfg):
        super().__init__(cfg)
        d, dp = cfg.data, dp_info()[1]
        train = self._pairs("train", d.max_train_samples)
        val = self._pairs("val", d.max_val_samples)
        self.val_pairs = val[:len(val) // dp * dp]
        self.train_loader = StatefulPromptLoader(train, d.train_batch_size, shuffle=d.shuffle, seed=d.seed,
                                                 drop_last=True, collate_fn=list)
        self.total_steps = self.steps_for(self.train_loader)
        self.fill_lr_decay_steps("actor", self.total_steps, epochs=1)
        self.actor = build_actor(cfg, self.hf_config, self.model_path, temperature=1.0)
        self.reference = build_reference(cfg, self.hf_config, self.model_path, temperature=1.0, actor=self.actor)
        self.loss = DPOLoss(cfg.algorithm.dpo)
        self.val_ref_logps = None  # the reference's validation log-probs never change: computed once

    def _pairs(self, split: str, max_samples) -> list[dict]:
        d = self.cfg.data
        rows = load_preference_dataset(self.data_files(split), max_samples, split=split)
        return encode_preference_pairs(self.tokenizer, rows, d.max_prompt_length, d.max_response_length)

    def _batch(self, pairs) -> dict:
        return build_pair_batch(pairs, self.tokenizer.pad_token_id, self.cfg.data.max_response_length)

    def train_step(self, step: int) -> dict:
        """Reference log-probs of the next ``data.train_batch_size`` pairs, then the DPO update."""
        batch = self._batch(self.train_loader.next_batch())
        batch["ref_logps"] = sequence_log_probs(self.reference, batch)
        m = self.actor.update_policy(batch, self.loss, step=step, epochs=1)
        m.update(padding_metrics([self.actor, self.reference]))  # perf/padding_efficiency
        m["_tokens"] = float(batch["attention_mask"].sum())
        return m

    def validate(self) -> dict:
        """Preference accuracy and DPO loss of the current actor on the validation pairs."""
        dp = dp_info()[1]
        bs = max(dp, self.cfg.data.val_batch_size // dp * dp)  # pairs per batch; a multiple of dp, like len(val_pairs)
        logps, refs, lengths = [], [], []
        for i in range(0, len(self.val_pairs), bs):
            batch = self._batch(self.val_pairs[i:i + bs])
            logps.append(sequence_log_probs(self.actor, batch))
            lengths.append(batch["response_mask"].sum(1))
            if self.val_ref_logps is None:
                refs.append(sequence_log_probs(self.reference, batch))
        if self.val_ref_logps is None:
            self.val_ref_logps = torch.cat(refs)
        logps = torch.cat(logps)
        _, m = dpo_loss_and_metrics(logps, self.val_ref_logps, torch.cat(lengths), self.cfg.algorithm.dpo)
        return {"val/preference_accuracy": float(m["dpo/accuracy"]), "val/dpo_loss": float(m["dpo/loss"]),
                "val/margin": float(m["dpo/margin"]),
                "val/logp_accuracy": float((logps[0::2] > logps[1::2]).float().mean())}

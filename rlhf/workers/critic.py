"""The critic on megatron: values V(s_t) of the response positions and the value update."""
from __future__ import annotations

from rlhf import algorithms as algos

from .batch import MODEL_KEYS, dp_all_gather, dp_info, dp_slice
from .dynamic_batch import token_budgets
from .losses import LOSS_MASK_KEY, split_scale
from .worker import LOSS_TOKENS_KEY, MegatronWorker, gather_metrics, step_metrics

__all__ = ["MegatronCritic", "CRITIC_TOKEN_MEANS"]

#: the value loss metrics that are means over the loss tokens (token-weighted by gather_metrics)
CRITIC_TOKEN_MEANS = ("critic/vf_clipfrac", "critic/vpred_mean")


class MegatronCritic(MegatronWorker):
    """A value model (`bundle` built with role "critic": a scalar head) and its `state`.  `cfg` is the
    config's ``critic`` section; `forward_micro_batch_size` bounds the no-grad value forward.  With
    ``critic.use_dynamic_bsz`` micro batches are cut by token budgets instead
    (``critic.forward_max_token_len_per_gpu`` / ``critic.ppo_max_token_len_per_gpu``, rlhf.workers.dynamic_batch).
    Methods are collective over the trainer job."""

    def __init__(self, bundle, state, cfg, *, forward_micro_batch_size: int):
        forward_budget, self.update_budget = token_budgets(cfg, "forward_max_token_len_per_gpu")
        super().__init__(bundle, state, forward_micro_batch_size=forward_micro_batch_size,
                         forward_max_tokens=forward_budget)
        self.cfg = cfg

    def compute_values(self, batch: dict):
        """Values for each response position t: the value head at the token before it, [N, R] float32
        on every rank, 0 outside the response mask."""
        rank, size, group = dp_info()
        out = self.forward(batch, kind="values")
        P, R = batch["prompt_length"], batch["responses"].shape[1]
        values = out["values"][:, P - 1:P - 1 + R] * dp_slice(batch["response_mask"], rank, size)
        return dp_all_gather(values.contiguous(), group, size)

    def update_critic(self, batch: dict, *, step: int) -> dict:
        """Clipped value loss (PPO2 / verl convention, ``cliprange_value``, ``loss_agg_mode``) against
        ``returns`` on the ``loss_mask`` tokens (the response mask when the batch has none), aggregated with
        the whole mini batch's counts (invariant to micro batches and data parallelism, see
        rlhf.workers.losses), with the actor's batching (``critic.ppo_epochs``, mini and micro batch sizes).
        Returns critic/vf_loss, critic/vf_clipfrac, critic/vpred_mean (these two token-weighted over micro batches
        and ranks, rlhf.workers.worker.gather_metrics) and the step metrics
        (rlhf.workers.worker.step_metrics: critic/grad_norm, critic/num_skipped_steps, critic/lr, ...)."""
        cfg = self.cfg
        P, R = batch["prompt_length"], batch["responses"].shape[1]
        mask_key = LOSS_MASK_KEY if LOSS_MASK_KEY in batch else "response_mask"

        def loss_fn(outs, mb):
            info, n_micro = split_scale(mb)
            mask = mb[mask_key]
            vpreds = outs["values"][:, P - 1:P - 1 + R]  # the value head at the token before each response token
            vf_loss, vf_clipfrac = algos.compute_value_loss(vpreds, mb["returns"], mb["values"], mask,
                                                            cfg.cliprange_value, cfg.loss_agg_mode, **info)
            return vf_loss * n_micro, {"critic/vf_loss": vf_loss.detach() * n_micro,
                                       "critic/vf_clipfrac": vf_clipfrac.detach(),
                                       "critic/vpred_mean": algos.masked_mean(vpreds, mask).detach(),
                                       LOSS_TOKENS_KEY: (mask != 0).sum()}

        per_micro, steps = self.train_mini_batches(
            batch, MODEL_KEYS + tuple(dict.fromkeys(("values", "returns", "response_mask", mask_key))), loss_fn,
            mini_batch_size=cfg.ppo_mini_batch_size, micro_batch_size_per_gpu=cfg.ppo_micro_batch_size_per_gpu,
            epochs=cfg.ppo_epochs, step=step, seed_offset=7,
            global_info=lambda full, dp: algos.global_batch_info(full[mask_key], dp),
            max_tokens_per_micro_batch=self.update_budget, shuffle=cfg.shuffle, kind="values")
        return {**gather_metrics(per_micro, CRITIC_TOKEN_MEANS), **step_metrics("critic", steps)}

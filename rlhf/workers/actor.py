"""The actor (and the frozen reference) on megatron: per-token log-probs and the policy update."""
from __future__ import annotations

from parallel.moe import MoEMetrics
from parallel.router_replay import RoutingReplay, routing_agreement

from .batch import MODEL_KEYS, dp_all_gather, dp_info
from .dynamic_batch import token_budgets
from .worker import MegatronWorker, gather_metrics, step_metrics

__all__ = ["MegatronActor"]


class MegatronActor(MegatronWorker):
    """`bundle` (parallel.models.ModelBundle) with its `state` (parallel.optim.TrainState; None for a
    frozen reference).  `cfg` is the config's ``actor`` section (micro/mini batch sizes, ppo_epochs);
    `temperature` divides the logits before every log-prob (the rollout's, so the trainer's log-probs
    match the engine's).  With ``actor.use_dynamic_bsz`` micro batches are cut by token budgets
    (``actor.log_prob_max_token_len_per_gpu`` / ``actor.ppo_max_token_len_per_gpu``, :func:`token_budgets`,
    rlhf.workers.dynamic_batch).  Methods are collective over the trainer job.

    MoE routing replay (parallel.router_replay; the bundle built with ``moe_enable_routing_replay``):
    `router_replay` is verl's ``actor.router_replay.mode``: "R3" replays the engines' routing (the batch's
    ``routed_experts``) in the old-log-prob and update forwards, "R2" records the old-log-prob forward's routing
    (returned as ``routed_experts``) and the update replays it, "disabled" replays nothing; whenever the batch
    holds the engines' routing (``rollout.enable_rollout_routing_replay``) the old-log-prob forward reports
    ``moe/routing_agreement``."""

    routing = None  # parallel.router_replay.RoutingReplay of a model built for routing replay
    router_replay = "disabled"

    def __init__(self, bundle, state, cfg, *, temperature: float = 1.0, router_replay: str = "disabled"):
        forward_budget, self.update_budget = token_budgets(cfg, "log_prob_max_token_len_per_gpu")
        super().__init__(bundle, state, forward_micro_batch_size=cfg.log_prob_micro_batch_size_per_gpu,
                         forward_max_tokens=forward_budget)
        self.cfg, self.temperature = cfg, temperature
        self.moe = MoEMetrics(bundle.chunks) if state is not None and bundle.spec.is_moe else None  # moe/* metrics
        self.router_replay = router_replay
        self.routing = RoutingReplay(bundle.chunks) if getattr(bundle.config, "moe_enable_routing_replay", False) \
            else None

    def compute_log_prob(self, batch: dict, *, calculate_entropy: bool = False) -> dict:
        """Per-token ``log_probs`` (and ``entropy`` when asked) of the response tokens, [N, R] float32 on
        every rank (natural log; 0 on padding).  With routing replay (see the class): under R2 also
        ``routed_experts`` [N, S, L, k] (the routing this forward used, for the update to replay), and when the batch
        holds the engines' routing ``metrics`` {"moe/routing_agreement": the fraction of (token, MoE layer) pairs
        over ``routed_experts_mask`` whose top-k set here equals the engine's}.
        Raises ValueError under R3 for a batch without the engines' routing."""
        _, size, group = dp_info()
        kw = {}
        if self.routing is not None:
            kw = dict(routing=self.routing, record_routing=True)
            if self.router_replay == "R3":
                if "routed_experts" not in batch:
                    raise ValueError("actor.router_replay.mode=R3 replays the engines' routing, but the batch holds "
                                     "none; set rollout.enable_rollout_routing_replay=true (verl: "
                                     "actor_rollout_ref.rollout.enable_rollout_routing_replay=True)")
                kw["extra_keys"] = ("routed_experts",)
        out = self.forward(batch, kind="log_probs", vocab_size=self.vocab_size, temperature=self.temperature,
                           calculate_entropy=calculate_entropy, **kw)
        routed = out.pop("routed_experts", None)
        R = batch["responses"].shape[1]
        res = {k: dp_all_gather(v[:, -R:].contiguous(), group, size) for k, v in out.items()}
        if routed is not None:
            routed = dp_all_gather(routed.contiguous(), group, size)
            if self.router_replay == "R2":
                res["routed_experts"] = routed
            if "routed_experts_mask" in batch:
                agree, pairs = routing_agreement(routed, batch["routed_experts"], batch["routed_experts_mask"])
                res["metrics"] = {"moe/routing_agreement": agree / pairs if pairs else 1.0}
        return res

    def update_policy(self, batch: dict, loss, *, step: int, epochs: int | None = None) -> dict:
        """Update the actor on `batch` with `loss` (rlhf.workers.losses: PPOPolicyLoss, DPOLoss):
        `epochs` (default ``actor.ppo_epochs``) passes, one optimizer step per ``actor.ppo_mini_batch_size``
        prompts, micro batches of ``actor.ppo_micro_batch_size_per_gpu`` sequences (or, with
        ``actor.use_dynamic_bsz``, of at most ``actor.ppo_max_token_len_per_gpu`` tokens); the loss's
        ``global_info`` gives it the whole mini batch's counts (split-invariant losses).  Returns the loss's
        metrics averaged over micro batches and ranks (its ``token_means``, e.g. actor/pg_clipfrac and
        actor/ppo_kl, token-weighted: rlhf.workers.worker.gather_metrics), plus actor/grad_norm (mean over optimizer steps),
        actor/num_skipped_steps, actor/num_breaker_events and actor/lr (rlhf.workers.worker.step_metrics)."""
        cfg, P = self.cfg, batch["prompt_length"]
        replay = {}
        if self.routing is not None and self.router_replay in ("R2", "R3"):
            if "routed_experts" not in batch:
                raise ValueError(f"actor.router_replay.mode={self.router_replay}: the update replays routing the "
                                 f"batch does not hold (R2 records it in the old-log-prob forward, which "
                                 f"algorithm.rollout_correction.bypass_mode=true skips; R3 needs "
                                 f"rollout.enable_rollout_routing_replay=true)")
            replay = {"routing": self.routing}
        if self.moe is not None:
            self.moe.reset()
        per_micro, steps = self.train_mini_batches(
            batch, MODEL_KEYS + tuple(loss.keys) + (("routed_experts",) if replay else ()),
            lambda outs, mb: loss(outs, mb, P),
            mini_batch_size=cfg.ppo_mini_batch_size,
            micro_batch_size_per_gpu=cfg.ppo_micro_batch_size_per_gpu,
            epochs=cfg.ppo_epochs if epochs is None else epochs, step=step, micro_group=loss.micro_group,
            global_info=getattr(loss, "global_info", None), max_tokens_per_micro_batch=self.update_budget,
            shuffle=cfg.shuffle,
            kind="log_probs", vocab_size=self.vocab_size,
            temperature=self.temperature, calculate_entropy=loss.needs_entropy, **replay)
        metrics = {**gather_metrics(per_micro, getattr(loss, "token_means", ())),  # token means token-weighted
                   **step_metrics("actor", steps)}  # actor/lr: the LR the update used
        if self.moe is not None:  # MoE: router aux loss and tokens per expert of this update (parallel.moe)
            metrics.update(self.moe.collect())
        return metrics

"""Gradients under sequence parallelism (TP2): one update of the critic and of the actor with SP on and off.

Called from tests/support/dist/vpp_checks.py (its 2-process launch; this needs world size 2 = TP2).  Both runs
load the same HF weights and the same value head at the same TP2 layout, so each rank holds the same parameter
shards either way and the two runs' per-rank gradients are compared parameter by parameter (every one of them),
together with the `<role>/grad_norm` metric the update returns (what clipping uses).

What goes wrong when a module whose computation is replicated on every TP rank (the critic's value head) gathers
its sequence-parallel input with megatron's reduce-scatter backward (`tensor_parallel_output_grad=True`): the TP
ranks' identical gradients are summed, so every trunk gradient comes out x TP while the head's stays x 1.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.distributed import init_model_parallel, set_seed

SP_CHECKS = ("sequence_parallel_tp2_critic_grads_equal_every_param", "sequence_parallel_tp2_actor_grads_equal_every_param")
TOL = 1e-6  # max |g_sp - g_no_sp| over every parameter, relative to max(1, max |g|)


def _batch(seed: int = 3) -> dict:
    """4 sequences of odd total length (prompt 4 + response 5 = 9: SP pads it to 10), some padding each side."""
    from rlhf.workers.batch import build_batch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 1000, (4 - i % 2,), generator=g).tolist() for i in range(4)]
    responses = [torch.randint(4, 1000, (5 - (i * 2) % 3,), generator=g).tolist() for i in range(4)]
    batch = build_batch(prompts, responses, pad_token_id=3, max_response_length=5)
    batch["n"] = 1
    R = 5
    batch["values"] = torch.randn(4, R, generator=g) * 0.1 * batch["response_mask"]
    batch["returns"] = torch.randn(4, R, generator=g) * batch["response_mask"]
    batch["old_log_probs"] = None  # filled from the actor's own forward
    batch["advantages"] = torch.tensor([[1.0], [-0.5], [0.25], [-1.0]]).expand(4, R) * batch["response_mask"]
    batch["loss_mask"] = batch["response_mask"]
    return batch


def _grads(model) -> dict:
    """{name: this rank's fp32 gradient} of every trainable parameter (megatron DDP's main_grad)."""
    from parallel.convert import unwrap_model

    return {n: p.main_grad.detach().clone() for n, p in unwrap_model(model[0]).named_parameters() if p.requires_grad}


def _run(path: str, sp: bool, head: torch.Tensor, cfg) -> dict:
    """One critic update and one actor update (clip_grad off) at TP2; returns the grad norms and gradients."""
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from parallel.models import build_model_chunks
    from parallel.optim import OptimConfig, build_train_state
    from rlhf.workers.actor import MegatronActor
    from rlhf.workers.critic import MegatronCritic
    from rlhf.workers.losses import PPOPolicyLoss

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    init_model_parallel(tp=2, pp=1)
    set_seed(7)
    hf = AutoConfig.from_pretrained(path)
    optim = OptimConfig(lr=1e-3, adam_eps=1e-4, clip_grad=0.0, use_distributed_optimizer=False)
    out = {}
    critic_b = build_model_chunks(hf, "critic", path, sequence_parallel=sp)
    out["sp_config"] = critic_b.config.sequence_parallel
    critic_b.chunks[-1].output_layer.weight.data.copy_(head)  # the same value head with SP on and off
    critic = MegatronCritic(critic_b, build_train_state(critic_b.chunks, critic_b.config, optim, role="critic"),
                            cfg.critic, forward_micro_batch_size=2)
    batch = _batch()
    m = critic.update_critic(batch, step=1)
    out["critic"] = (m["critic/grad_norm"], _grads(critic.state.model))
    actor_b = build_model_chunks(hf, "actor", path, sequence_parallel=sp)
    actor = MegatronActor(actor_b, build_train_state(actor_b.chunks, actor_b.config, optim), cfg.actor)
    batch["old_log_probs"] = actor.compute_log_prob(batch)["log_probs"] - 0.05
    m = actor.update_policy(batch, PPOPolicyLoss(cfg.actor), step=1)
    out["actor"] = (m["actor/grad_norm"], _grads(actor.state.model))
    return out


def check_sp_gradients(path: str) -> dict:
    """{check name: (ok, detail)} for the critic and the actor: every parameter's gradient and the grad-norm
    metric equal with SP on and off at TP2 (needs a world size of 2)."""
    from rlhf.config import compose_config
    from transformers import AutoConfig

    cfg = compose_config(["actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=2",
                          "actor.log_prob_micro_batch_size_per_gpu=4", "actor.entropy_coeff=0.01",
                          "critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=2"])
    g = torch.Generator().manual_seed(5)
    head = torch.randn(1, AutoConfig.from_pretrained(path).hidden_size, generator=g) * 0.1
    off, on = _run(path, False, head, cfg), _run(path, True, head, cfg)
    results = {}
    for role in ("critic", "actor"):
        (norm_off, g_off), (norm_on, g_on) = off[role], on[role]
        if not on["sp_config"] or off["sp_config"] or set(g_off) != set(g_on):
            results[role] = (False, f"SP flag not applied or parameter names differ: "
                                    f"{sorted(set(g_off) ^ set(g_on))[:4]}")
            continue
        worst, worst_name, ratios = 0.0, None, {}
        for n in g_off:
            d = (g_on[n] - g_off[n]).abs().max().item() / max(1.0, g_off[n].abs().max().item())
            if d > worst:
                worst, worst_name = d, n
            ratios[n] = g_on[n].norm().item() / max(g_off[n].norm().item(), 1e-30)
        # the worst over both TP ranks (each compares its own shards)
        t = torch.tensor([worst])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        worst = t.item()
        head_name = "output_layer.weight"
        detail = (f"{len(g_off)} params max_rel_diff={worst:.2e} (rank {dist.get_rank()} worst {worst_name}) "
                  f"grad_norm SP on/off={norm_on:.6f}/{norm_off:.6f} ratio={norm_on / norm_off:.4f} "
                  f"trunk_norm_ratio(decoder.final_layernorm)={ratios.get('decoder.final_layernorm.weight', 0):.4f}"
                  + (f" head_norm_ratio={ratios[head_name]:.4f}" if head_name in ratios else ""))
        ok = worst <= TOL and abs(norm_on - norm_off) <= 1e-5 * norm_off
        results[role] = (ok, detail)
    return {SP_CHECKS[0]: results["critic"], SP_CHECKS[1]: results["actor"]}

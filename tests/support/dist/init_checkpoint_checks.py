"""Initial weights from a megatron dist checkpoint (``<role>.use_dist_checkpointing``; parallel.init_checkpoint),
through the trainer's own builders.  Launched by tests/e2e/test_init_checkpoint_dist.py:

    torchrun --nproc_per_node=2 tests/support/dist/init_checkpoint_checks.py --workdir DIR

Tiny random models (tests/support/model_families.py, 2 layers): DeepSeek-V3 (MLA, 1 dense + 1 MoE layer, untied)
converted at TP2 with its vocabulary padded to 1000 rows (``make_vocab_size_divisible_by=100``; a TP1 run pads
to 1024 by default), Qwen3 (tied embeddings, q/k norm) converted at PP2, both with
``parallel.init_checkpoint.write_model_checkpoint`` (what ``convert_checkpoint.py hf-to-mcore`` writes).

  cfg_check_accepts_the_converted_checkpoints   check_model_checkpoint finds nothing wrong with either, at TP1/TP2
  cfg_check_names_the_mismatch   the DeepSeek-V3 checkpoint against Qwen3's config.json: the --cfg error names the
                                 key and the foreign tensors; against a 3-layer DeepSeek-V3 config: the layer count
  <model>_<from>_to_<layout>_*   actor, reference and critic built by rlhf.workers.build from the checkpoint vs
                                 from the HF safetensors in the same layout (DeepSeek-V3 at TP1 and PP2: a stage
                                 with only the dense layer; Qwen3 at TP2):
      _build         the model keeps the checkpoint's padded vocabulary
      _weights       every tensor of the three roles (the critic's new value head aside) bitwise equal
      _log_probs     the actor's log-probs on a batch equal (<= 1e-6; also against an HF start at the default
                     padding, 1024 rows)
      _first_update  one actor update (PPO loss; the MoE's router aux loss on): metrics and weights after it equal
                     (<= 1e-6), weights changed, moe/* metrics present
  qwen3_pp2_to_tp1_ppo_*         PPOTrainer (GAE critic, KL in the reward; rollouts from the in-process HF engine
                                 double, tests/support/hf_sampling_engine.py) from the checkpoint, its model.path
                                 holding OTHER weights (the engine starts from those), vs from HF: weights,
                                 log-probs, one train_step (value head copied over) equal: the engine got the
                                 actor's weights before the first rollout
Each check prints `CHECK <name> PASS|FAIL <detail>` on rank 0.
"""
import argparse
import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import rlhf.workers.rollout  # noqa: E402
from tests.support.hf_sampling_engine import start_hf_sampling_engine  # noqa: E402
from tests.support.dist.checks import run_check  # noqa: E402

rlhf.workers.rollout.start_rollout = start_hf_sampling_engine
STEP_METRICS = ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm", "critic/score/mean",
                "actor/rollout_log_prob_diff")


def make_model(workdir, kind, seed=5, name=None):
    from rlhf.quickstart.tokenizer import make_quickstart_tokenizer
    from tests.support.model_families import make_family_model

    path = os.path.join(workdir, name or kind)
    if dist.get_rank() == 0:
        make_family_model(path, kind, num_layers=2, seed=seed)
        make_quickstart_tokenizer().save_pretrained(path)  # ids < 400 < vocab 1000
    dist.barrier()
    return path


def convert(path, out, tp, pp, divisible_by):
    """What convert_checkpoint.py hf-to-mcore does, at tp x pp."""
    from transformers import AutoConfig

    from parallel.distributed import init_model_parallel
    from parallel.init_checkpoint import write_model_checkpoint
    from parallel.models import build_model_chunks

    init_model_parallel(tp, pp)
    bundle = build_model_chunks(AutoConfig.from_pretrained(path), "actor", path,
                                make_vocab_size_divisible_by=divisible_by)
    write_model_checkpoint(path, out, bundle.chunks)


def trainer(model, workdir, extra):
    from megatron.core import parallel_state as ps

    from rlhf.config import compose_config, validate_config
    from rlhf.trainer.ppo_trainer import PPOTrainer

    if ps.model_parallel_is_initialized():  # the trainer initialises its own layout (and seeds)
        ps.destroy_model_parallel()
    cfg = compose_config([f"model.path={model}", f"trainer.default_local_dir={workdir}", "trainer.logger=[]",
                          "data.train_batch_size=2", "rollout.n=2", "data.max_response_length=6",
                          "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2", "actor.optim.lr=1e-2",
                          "critic.optim.lr=1e-2", "trainer.val_before_train=false", "trainer.progress_bar=false",
                          *extra], recipe="quickstart")
    validate_config(cfg, world_size=dist.get_world_size())
    return PPOTrainer(cfg)


def hf_tensors(role):
    """{HF name: full tensor} of a role's chunks (collective; the critic's value head left out)."""
    from parallel.convert import iter_hf_tensors

    return {n: t.clone() for n, t in iter_hf_tensors(role.chunks, role.bundle.spec)}


def roles(t):
    return {"actor": t.actor, "reference": t.reference, "critic": t.critic}


def same_tensors(a, b, tol=0.0):
    """(all equal within tol, max abs diff, names that differ)."""
    if a.keys() != b.keys():
        return False, float("inf"), sorted(set(a) ^ set(b))[:3]
    diffs = {n: float((a[n].float() - b[n].float()).abs().max()) for n in a}
    worst = max(diffs.values())
    return worst <= tol, worst, [n for n, d in diffs.items() if d > tol][:3]


def probe_batch(t):
    from rlhf.workers.batch import build_batch

    p = t.cfg.parallel
    dp = dist.get_world_size() // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)
    b = build_batch([[5, 17, 230, 9], [44, 3]] * dp, [[8, 91, 300], [10, 11, 12, 13]] * dp, 0, 6)
    b["n"] = 1
    return b


def log_probs(actor, batch):
    return actor.compute_log_prob(batch)["log_probs"].float()


def cfg_checks(models, ckpts, workdir):
    from transformers import AutoConfig

    from parallel.init_checkpoint import check_model_checkpoint
    from rlhf.config import ConfigValidationError, compose_config, validate_config

    def accepts():
        found = {k: check_model_checkpoint(ckpts[k], AutoConfig.from_pretrained(models[k]), tp=tp)
                 for k in ckpts for tp in (1, 2)}
        return not any(found.values()), f"problems {found}"

    def names_mismatch():
        try:
            validate_config(compose_config([f"model.path={models['qwen3']}", "actor.use_dist_checkpointing=true",
                                            f"actor.dist_checkpointing_path={ckpts['deepseek_v3']}",
                                            f"trainer.default_local_dir={workdir}"], recipe="quickstart"),
                            check_files=True)
            return False, "accepted"
        except ConfigValidationError as e:
            msg = str(e)
        three = check_model_checkpoint(ckpts["deepseek_v3"],
                                       AutoConfig.from_pretrained(models["deepseek_v3"], num_hidden_layers=3))
        ok = ("actor.dist_checkpointing_path=" in msg and "a Qwen3ForCausalLM (config.json) does not have, e.g. "
              "decoder.layers.0.self_attention.linear_q_down_proj.weight" in msg
              and any("num_hidden_layers=3" in p for p in three))
        return ok, f"{msg.splitlines()[1:3]} | {three}"

    run_check("cfg_check_accepts_the_converted_checkpoints", accepts)
    run_check("cfg_check_names_the_mismatch", names_mismatch)


def compare_with_hf_start(kind, name, model, ckpt, workdir, extra, run_model):
    """The run from the checkpoint (its model.path `run_model`: the same config.json, OTHER weights) vs the run
    from the HF safetensors of `model` (the checkpoint's weights): weights, log-probs, first step.  The first
    step's rollouts are the same only if the engine generates with the actor's weights, not run_model's."""
    init = ["actor.use_dist_checkpointing=true", f"actor.dist_checkpointing_path={ckpt}",
            "critic.use_dist_checkpointing=true", f"critic.dist_checkpointing_path={ckpt}"]
    ref_t = trainer(model, os.path.join(workdir, f"{name}_hf"), extra)
    t = trainer(run_model, os.path.join(workdir, name), extra + init)
    try:
        def weights():
            out = []
            for role, r in roles(t).items():
                ok, worst, bad = same_tensors(hf_tensors(r), hf_tensors(roles(ref_t)[role]))
                out.append((role, ok, bad))
            return all(ok for _, ok, _ in out), f"bitwise per role {out}"

        def lp():
            b = probe_batch(t)
            d = float((log_probs(t.actor, b) - log_probs(ref_t.actor, b)).abs().max())
            return d <= 1e-6, f"max_abs_diff={d:.2e} padded vocab {t.actor.bundle.padded_vocab_size} vs " \
                              f"{ref_t.actor.bundle.padded_vocab_size}"

        def first_step():
            head, ref_head = (unwrap_last(x.critic).output_layer for x in (t, ref_t))
            with torch.no_grad():  # the value head is new in both runs: the same values for the comparison
                for p, q in zip(head.parameters(), ref_head.parameters()):
                    p.copy_(q)
            before = hf_tensors(t.actor)
            m, ref_m = t.train_step(1), ref_t.train_step(1)
            diffs = {k: abs(m[k] - ref_m[k]) for k in STEP_METRICS}
            same, worst, _ = same_tensors(hf_tensors(t.actor), hf_tensors(ref_t.actor), tol=1e-6)
            changed = not same_tensors(hf_tensors(t.actor), before)[0]
            ok = same and changed and all(d <= 1e-6 for d in diffs.values()) and torch.isfinite(
                torch.tensor(m["actor/pg_loss"]))
            return ok, f"metric diffs {diffs}, weights after max_abs_diff={worst:.2e}, changed={changed}"

        run_check(f"{name}_weights", weights)
        run_check(f"{name}_log_probs", lp)
        run_check(f"{name}_first_step", first_step)
    finally:
        t.close()
        ref_t.close()


def unwrap_last(role):
    from parallel.convert import unwrap_model

    return unwrap_model(role.chunks[-1])


def build_roles(model, workdir, extra, init):
    """The actor, reference and critic as the trainer builds them (rlhf.workers.build), in the layout of `extra`."""
    from transformers import AutoConfig

    from parallel.distributed import init_model_parallel, set_seed
    from rlhf.config import compose_config
    from rlhf.workers.build import build_actor, build_critic, build_reference

    cfg = compose_config([f"model.path={model}", f"trainer.default_local_dir={workdir}", "actor.optim.lr=1e-2",
                          "actor.ppo_mini_batch_size=2", "algorithm.adv_estimator=gae", *extra, *init],
                         recipe="quickstart")
    p = cfg.parallel
    init_model_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size)
    set_seed(cfg.trainer.seed)
    # megatron's aux-loss tracker is process-global: empty, as in a fresh run (a stage without MoE layers has none)
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()
    hf = AutoConfig.from_pretrained(model)
    actor = build_actor(cfg, hf, model, temperature=1.0)
    return cfg, {"actor": actor, "reference": build_reference(cfg, hf, model, temperature=1.0, actor=actor),
                 "critic": build_critic(cfg, model)}


def update_batch(actor, cfg):
    """A PPO mini batch for `actor.update_policy`: the probe rows, their old log-probs, advantages +-1."""
    from rlhf.workers.losses import LOSS_MASK_KEY

    b = probe_batch(type("T", (), {"cfg": cfg})())
    b["old_log_probs"] = log_probs(actor, b)
    mask = b["response_mask"].float()
    b["advantages"] = mask * torch.tensor([1.0, -1.0] * (mask.shape[0] // 2)).unsqueeze(1)
    b[LOSS_MASK_KEY] = mask
    return b


def start_from_checkpoint(kind, name, model, ckpt, workdir, extra, vocab_rows=None):
    """Actor, reference and critic built from the checkpoint (another layout) vs from the HF safetensors (same
    layout): weights bitwise, log-probs, one actor update (PPO loss; moe/* metrics for MoE models).
    `vocab_rows`: the checkpoint's padded vocabulary when a run from HF pads differently; the HF start then pads
    to it too (the first update is bitwise only with the same padding: Adam magnifies the last-bit differences
    of reductions over 1000 vs 1024 rows to ~1e-5 in the weights), and the log-probs are also compared with
    an HF start at the default padding."""
    from rlhf.workers.losses import PPOPolicyLoss

    init = ["actor.use_dist_checkpointing=true", f"actor.dist_checkpointing_path={ckpt}",
            "critic.use_dist_checkpointing=true", f"critic.dist_checkpointing_path={ckpt}"]
    box = {}

    def build():
        if vocab_rows:
            box["hf_default"] = build_roles(model, os.path.join(workdir, name), extra, [])[1]["reference"]
        padding = [f"model.make_vocab_size_divisible_by={vocab_rows}"] if vocab_rows else []  # at TP1
        box["hf"] = build_roles(model, os.path.join(workdir, name), extra + padding, [])[1]
        box["cfg"], box["ckpt"] = build_roles(model, os.path.join(workdir, name), extra, init)
        rows = box["ckpt"]["actor"].bundle.padded_vocab_size
        return rows == (vocab_rows or rows), f"padded vocabulary {rows} (the checkpoint's)"

    def weights():
        out = [(role, *same_tensors(hf_tensors(r), hf_tensors(box["hf"][role]))[::2])
               for role, r in box["ckpt"].items()]
        return all(ok for _, ok, _ in out), f"bitwise per role {out}"

    def lp():
        b = probe_batch(type("T", (), {"cfg": box["cfg"]})())
        a = box["ckpt"]["actor"]
        d = {h.bundle.padded_vocab_size: float((log_probs(a, b) - log_probs(h, b)).abs().max())
             for h in (box["hf"]["actor"], box.get("hf_default", box["hf"]["actor"]))}
        return max(d.values()) <= 1e-6, f"max_abs_diff vs HF starts by their padded vocabulary {d}"

    def first_update():
        a, h = box["ckpt"]["actor"], box["hf"]["actor"]
        before = hf_tensors(a)
        m = a.update_policy(update_batch(a, box["cfg"]), PPOPolicyLoss(box["cfg"].actor), step=1)
        ref_m = h.update_policy(update_batch(h, box["cfg"]), PPOPolicyLoss(box["cfg"].actor), step=1)
        keys = [k for k in ("actor/pg_loss", "actor/grad_norm", "moe/load_balancing_loss",
                            "moe/tokens_per_expert_max") if k in ref_m]
        diffs = {k: abs(m[k] - ref_m[k]) for k in keys}
        same, worst, _ = same_tensors(hf_tensors(a), hf_tensors(h), tol=1e-6)
        changed = not same_tensors(hf_tensors(a), before)[0]
        moe_ok = kind != "deepseek_v3" or {"moe/load_balancing_loss", "moe/tokens_per_expert_max"} <= set(m)
        ok = same and changed and moe_ok and all(d <= 1e-6 for d in diffs.values())
        return ok, f"metric diffs {diffs}, weights after max_abs_diff={worst:.2e}, changed={changed}"

    run_check(f"{name}_build", build)
    if "ckpt" in box:
        run_check(f"{name}_weights", weights)
        run_check(f"{name}_log_probs", lp)
        run_check(f"{name}_first_update", first_update)
    box.clear()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    from parallel.distributed import init_distributed

    init_distributed()
    os.makedirs(args.workdir, exist_ok=True)
    models = {k: make_model(args.workdir, k) for k in ("deepseek_v3", "qwen3")}
    ckpts = {"deepseek_v3": os.path.join(args.workdir, "mcore_deepseek_v3_tp2"),
             "qwen3": os.path.join(args.workdir, "mcore_qwen3_pp2")}
    convert(models["deepseek_v3"], ckpts["deepseek_v3"], tp=2, pp=1, divisible_by=100)
    convert(models["qwen3"], ckpts["qwen3"], tp=1, pp=2, divisible_by=128)
    cfg_checks(models, ckpts, args.workdir)
    moe = ["model.moe_aux_loss_coef=0.01"]  # the router's aux loss is tracked (moe/load_balancing_loss)
    start_from_checkpoint("deepseek_v3", "deepseek_v3_tp2_to_tp1", models["deepseek_v3"], ckpts["deepseek_v3"],
                          args.workdir, moe, vocab_rows=1000)
    start_from_checkpoint("deepseek_v3", "deepseek_v3_tp2_to_pp2", models["deepseek_v3"], ckpts["deepseek_v3"],
                          args.workdir, moe + ["parallel.pipeline_model_parallel_size=2"], vocab_rows=1000)
    start_from_checkpoint("qwen3", "qwen3_pp2_to_tp2", models["qwen3"], ckpts["qwen3"], args.workdir,
                          ["parallel.tensor_model_parallel_size=2"])
    other = make_model(args.workdir, "qwen3", seed=6, name="qwen3_other_weights")
    compare_with_hf_start("qwen3", "qwen3_pp2_to_tp1_ppo", models["qwen3"], ckpts["qwen3"], args.workdir,
                          ["algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true"], run_model=other)
    from parallel.distributed import destroy_distributed

    destroy_distributed()


if __name__ == "__main__":
    main()

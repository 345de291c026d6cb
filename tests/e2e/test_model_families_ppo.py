"""A short PPO run (3 steps, CPU, real SGLang engine) through `python -m rlhf.main` on a tiny Qwen3 (trainer PP2
with an uneven split, 1 + 2 layers), a tiny Qwen3-MoE (8 experts, top-2) and a tiny DeepSeek-V3 (multi-latent
attention, 1 dense + 1 MoE layer: 8 routed experts in 2 groups, sigmoid router with correction bias, a shared
expert; its CPU engine's prefill corrected in rlhf/rollout/sglang_cpu): the usual metrics plus moe/*.  The runs
start together (their engine start-ups overlap)."""
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.support.dist_utils import finish_group, main_cmd, start_group
from tests.e2e.test_trainer_e2e import METRICS
from tests.support.tracking_readers import run_scalars as scalars

pytestmark = [pytest.mark.slow, pytest.mark.sglang]
MOE_METRICS = ["moe/load_balancing_loss", "moe/tokens_per_expert_min", "moe/tokens_per_expert_max",
               "moe/expert_load_imbalance"]


def _model(path, kind, num_layers):
    from rlhf.quickstart.tokenizer import make_quickstart_tokenizer
    from tests.support.model_families import make_family_model

    make_family_model(str(path), kind, num_layers=num_layers)
    make_quickstart_tokenizer().save_pretrained(str(path))  # 400 ids < the model's 1000
    return str(path)


def _start(model, out, nproc, extra):
    """The run in its own process group, logging to out.log (tests/dist_utils.start_group)."""
    overrides = ["recipe=quickstart", f"model.path={model}", f"trainer.default_local_dir={out}",
                 "trainer.total_training_steps=3", "trainer.save_freq=-1", "trainer.test_freq=-1",
                 "trainer.val_before_train=false", "trainer.progress_bar=false", "data.train_batch_size=4",
                 "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2", "rollout.n=2",
                 "rollout.temperature=0", "data.max_response_length=8", "algorithm.use_kl_in_reward=true", *extra]
    log_path = f"{out}.log"
    return start_group(main_cmd(overrides, nproc), log_path), log_path


def _finish(proc, log_path, timeout=900):
    rc = finish_group(proc, timeout)
    return rc, open(log_path).read()


def test_ppo_three_steps_on_qwen3_pp2_uneven_qwen3_moe_and_deepseek_v3(tmp_path):
    qwen3 = _model(tmp_path / "qwen3", "qwen3", num_layers=3)
    moe = _model(tmp_path / "qwen3_moe", "qwen3_moe", num_layers=2)
    dsv3 = _model(tmp_path / "deepseek_v3", "deepseek_v3", num_layers=2)
    runs = {
        "qwen3": _start(qwen3, tmp_path / "run_qwen3", 2, ["parallel.pipeline_model_parallel_size=2",
                                                         "parallel.num_layers_in_first_pipeline_stage=1"]),
        "qwen3_moe": _start(moe, tmp_path / "run_moe", 1, ["model.moe_aux_loss_coef=0.01"]),
        "deepseek_v3": _start(dsv3, tmp_path / "run_dsv3", 1, ["model.moe_aux_loss_coef=0.01"]),
    }
    outs = {k: _finish(*v) for k, v in runs.items()}
    for k, (rc, out) in outs.items():
        assert rc == 0, f"{k}: exit {rc}\n{out[-6000:]}"
    for k, model, run in (("qwen3", qwen3, "run_qwen3"), ("qwen3_moe", moe, "run_moe"),
                          ("deepseek_v3", dsv3, "run_dsv3")):
        s = scalars(tmp_path / run)
        for tag in METRICS:
            assert all((tag, step) in s for step in (1, 2, 3)), f"{k}: {tag} not logged at every step"
        # the engine samples from the actor's model: its log-probs of the sampled tokens equal the trainer's
        drift = [s[("actor/rollout_log_prob_diff", step)] for step in (1, 2, 3)]
        assert max(drift) < 1e-3, f"{k}: engine vs trainer log-probs {drift}"
        export = load_file(str(next((tmp_path / run / "hf_export").glob("*.safetensors"))))
        init = load_file(os.path.join(model, "model.safetensors"))
        # PP2 exports one shard per stage: compare what this shard holds
        assert any(not torch.equal(export[n], init[n]) for n in export), f"{k}: training did not change the weights"
    for run in ("run_moe", "run_dsv3"):
        s = scalars(tmp_path / run)
        assert all((tag, step) in s for tag in MOE_METRICS for step in (1, 2, 3)), \
            (run, sorted(t for t, _ in s if t.startswith("moe")))
    s = scalars(tmp_path / "run_moe")
    for step in (1, 2, 3):
        lo, hi, imb = (s[(f"moe/{t}", step)] for t in ("tokens_per_expert_min", "tokens_per_expert_max",
                                                         "expert_load_imbalance"))
        assert 0 <= lo <= hi and hi > 0
        assert 1.0 <= imb <= 8 / 2 + 1e-6  # 1 = perfect balance, E / top-k = everything on top-k experts
        assert 0 < s[("moe/load_balancing_loss", step)] < 8  # Switch loss (unweighted): 1 when balanced
    assert not any(t.startswith("moe/") for t, _ in scalars(tmp_path / "run_qwen3"))  # dense: no moe/*

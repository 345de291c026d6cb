"""Config composition (Hydra + structured schema), validation and the `rlhf.main` entry point.  CPU only,
fast.  (The recipe launch scripts are tested in tests/unit/test_launch_scripts.py, the Dockerfile in
tests/unit/test_docker_requirements.py.)"""
from __future__ import annotations

import copy
import os
import subprocess
import textwrap
import sys
import types
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

import rlhf
from rlhf.config import (ConfigError, ConfigKeyError, ConfigValidationError, compose_config, list_recipes,
                         schema_keys, validate_config)
from rlhf.config.objects import format_value
from rlhf.config.schema import RLHFConfig
from rlhf.main import main, parse_args

from tests.support.paths import REPO
from tests.support.paths import FIXTURES as FIXTURES_DIR
# recipe -> number of trainer processes it is written for
RECIPES = {"quickstart": 1, "gsm8k_ppo_tiny_cpu": 2, "gsm8k_ppo_qwen2_7b": 8}


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID",
                                                          "SLURM_NTASKS", "SLURM_LOCALID")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(k, raising=False)


# --------------------------------------------------------------------------- composition


def test_recipes_are_listed():
    assert set(RECIPES) <= set(list_recipes())
    for name in RECIPES:
        assert (REPO / "recipes" / name).is_dir(), f"recipes/{name}/ (launch scripts) missing"


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_composes_and_validates(name):
    cfg = compose_config([], recipe=name)
    assert OmegaConf.get_type(cfg) is RLHFConfig
    validate_config(cfg, world_size=RECIPES[name])
    validate_config(cfg)  # world size unknown
    assert cfg.trainer.default_local_dir == f"outputs/{name}"
    OmegaConf.to_object(cfg)  # converts to the dataclasses


def test_recipe_values():
    q = compose_config([], recipe="quickstart")
    assert q.data.train_files == "embedded://arithmetic" and q.model.path == "tiny://quickstart"
    assert q.parallel.tensor_model_parallel_size == 1 and q.rollout.num_engines == 1
    assert q.algorithm.adv_estimator == "gae" and q.critic.enable is None
    assert 20 <= q.trainer.total_training_steps <= 30 and q.trainer.save_freq == 10 and q.trainer.test_freq == 10

    t = compose_config([], recipe="gsm8k_ppo_tiny_cpu")
    assert t.parallel.tensor_model_parallel_size == 2 and t.data.max_prompt_length == 512
    assert t.data.train_files.endswith("gsm8k/train.jsonl") and t.data.max_train_samples <= 256
    assert t.model.path == "tiny://quickstart" and t.trainer.total_training_steps <= 10

    g = compose_config([], recipe="gsm8k_ppo_qwen2_7b")
    assert g.model.path == "Qwen/Qwen2-7B-Instruct" and g.model.dtype == "bfloat16"
    assert (g.parallel.tensor_model_parallel_size, g.parallel.pipeline_model_parallel_size) == (4, 1)
    assert g.parallel.sequence_parallel and g.parallel.recompute == "full"
    assert g.rollout.tensor_model_parallel_size * g.rollout.num_engines == 8 and g.rollout.n == 5
    assert g.data.train_batch_size == 256 and g.data.max_prompt_length == g.data.max_response_length == 1024
    assert g.actor.optim.lr == 1e-6 and g.critic.optim.lr == 1e-5
    assert g.algorithm.use_kl_in_reward or g.actor.use_kl_loss
    assert g.trainer.resume_mode == "auto" and g.trainer.save_freq > 0 and g.trainer.test_freq > 0


def test_no_recipe_gives_schema_defaults():
    cfg = compose_config([])
    assert OmegaConf.to_container(cfg) == OmegaConf.to_container(OmegaConf.structured(RLHFConfig))


def test_overrides_apply_and_win_over_recipe():
    cfg = compose_config(["trainer.total_training_steps=3", "actor.optim.lr=3e-4", "rollout.val_kwargs.n=2",
                          "data.train_files=[a.jsonl,b.jsonl]", "trainer.logger=[console]"], recipe="quickstart")
    assert cfg.trainer.total_training_steps == 3 and cfg.actor.optim.lr == 3e-4 and cfg.rollout.val_kwargs.n == 2
    assert list(cfg.data.train_files) == ["a.jsonl", "b.jsonl"] and list(cfg.trainer.logger) == ["console"]
    assert cfg.trainer.default_local_dir == "outputs/quickstart"  # untouched recipe value
    # recipe=NAME as an override is the same as the argument
    assert compose_config(["recipe=quickstart"]) == compose_config([], recipe="quickstart")


def test_compose_from_any_cwd_and_leaves_hydra_clean(tmp_path, monkeypatch):
    from hydra.core.global_hydra import GlobalHydra

    monkeypatch.chdir(tmp_path)
    assert compose_config([], recipe="quickstart").trainer.experiment_name == "quickstart"
    assert not GlobalHydra.instance().is_initialized()


def test_compose_inside_an_initialized_hydra():
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    with initialize_config_module(config_module="rlhf.config", version_base="1.3"):
        assert compose_config([], recipe="quickstart").model.path == "tiny://quickstart"
        assert GlobalHydra.instance().is_initialized()  # the caller's Hydra is restored


def test_config_is_struct():
    cfg = compose_config([], recipe="quickstart")
    with pytest.raises(Exception):
        cfg.trainer.totl_training_steps  # noqa: B018


def test_interpolations_are_resolved(tmp_path):
    _write_recipe(tmp_path, "interp", """
        trainer:
          experiment_name: exp7
          default_local_dir: outputs/${trainer.experiment_name}
    """)
    cfg = compose_config([], recipe="interp", search_paths=[tmp_path])
    assert cfg.trainer.default_local_dir == "outputs/exp7"


FIXTURES = FIXTURES_DIR / "composed_recipes"
#: keys added to the schema after the recipes were captured, with their defaults
ADDED_KEYS = {
    "actor.optim.lr_decay_steps": None, "critic.optim.lr_decay_steps": None,  # the single OptimConfig
    # verl's policy-loss keys
    "actor.policy_loss": {"loss_mode": "vanilla", "clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0,
                          "kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1},
    "actor.tau_pos": 1.0, "actor.tau_neg": 1.05, "actor.loss_scale_factor": None,
    # numerical safety
    "reward.exclude_unscorable": True, "algorithm.overlong_filter": False,
    "reward.gsm8k": {"method": "strict", "format_score": 0.0},
    # verl's trainer / data keys
    "trainer.n_gpus_per_node": None, "trainer.nnodes": None, "trainer.critic_warmup": 0,
    "rollout.n_gpus_per_node": None, "rollout.nnodes": None,  # verl's rollout pool (one-step-off recipes)
    "trainer.log_val_generations": 0, "trainer.log_freq": 1,
    "data.filter_overlong_prompts": True, "data.truncation": "error", "data.apply_chat_template": None,
    "data.chat_template_kwargs": {},
    # safety: step guard, slim checkpoints, alerts, reward degradation
    **{f"{role}.optim.{k}": v for role in ("actor", "critic") for k, v in {
        "max_consecutive_skipped_steps": 10,
        "breaker": {"enable": True, "grad_norm": 100.0, "steps": 5, "warmup_steps": None}}.items()},
    "trainer.slim_checkpoint": True, "trainer.alerts": [],
    "rollout.weight_update_address": None,  # the disaggregated rendezvous address
    "rollout.enable_memory_saver": None,  # SGLang's memory saver (null: on with CUDA)
    "rollout.max_total_tokens": None,  # the engines' KV-cache size (null: sized to the batch)
    "reward.fallback": {"type": "rule", "keywords": [], "keyword_score": 0.0, "length_penalty": 0.0,
                        "max_chars": None},
    # dynamic batching (verl's token budgets)
    "actor.use_dynamic_bsz": False, "actor.ppo_max_token_len_per_gpu": 16384,
    "actor.log_prob_max_token_len_per_gpu": None, "critic.use_dynamic_bsz": False,
    "critic.ppo_max_token_len_per_gpu": 32768, "critic.forward_max_token_len_per_gpu": None,
    # MoE expert parallelism, router aux-loss coefficient, uneven pipelines
    "parallel.expert_model_parallel_size": 1, "model.moe_aux_loss_coef": None,
    "parallel.num_layers_in_first_pipeline_stage": None, "parallel.num_layers_in_last_pipeline_stage": None,
    # context parallelism (GPU with Transformer Engine)
    "parallel.context_parallel_size": 1,
    # verl's override_transformer_config fields: pipeline split with embedding / loss, router z-loss and dtype
    "parallel.account_for_embedding_in_pipeline_split": False, "parallel.account_for_loss_in_pipeline_split": False,
    "model.moe_z_loss_coeff": None, "model.moe_router_dtype": None,
    "model.moe_token_dispatcher_type": "alltoall", "model.moe_enable_deepep": False,  # DeepEP (flex dispatcher)
    # verl's global_profiler section (torch.profiler traces of the listed steps)
    "global_profiler": {"tool": None, "steps": None, "save_path": None, "profile_continuous_steps": False},
    # on-policy distillation (slime's --use-opd / --opd-kl-coef / --opd-teacher-load, rlhf/config/schema/distill.py)
    "distill": {"enable": False, "kl_coef": 1.0, "task_reward": True, "center": False,
                "teacher": {"path": None, "log_prob_micro_batch_size_per_gpu": None, "param_offload": False}},
    # LoRA on the actor (rank 0: off)
    "model.lora": {"rank": 0, "alpha": 16.0, "target_modules": "all-linear", "a_init": "xavier"},
    "model.lora.merge": False,  # LoRA synced as adapters (false) or merged into the base weights
    # offload between phases (verl's megatron.*_offload) and megatron-core's own optimizer options
    "actor.offload": {"params": False, "grads": False, "optimizer": False}, "actor.ref_param_offload": False,
    "critic.offload": {"params": False, "grads": False, "optimizer": False},
    **{f"{role}.optim.{k}": v for role in ("actor", "critic") for k, v in {
        "optimizer_cpu_offload": False, "optimizer_offload_fraction": 0.0, "use_precision_aware_optimizer": False,
        "main_grads_dtype": "fp32", "main_params_dtype": "fp32", "exp_avg_dtype": "fp32",
        "exp_avg_sq_dtype": "fp32"}.items()},
    # MoE routing replay (verl's actor.router_replay.mode, rollout.enable_rollout_routing_replay)
    "actor.router_replay": {"mode": "disabled"}, "rollout.enable_rollout_routing_replay": False,
    # initial weights from a megatron dist checkpoint (verl's megatron.use_dist_checkpointing)
    **{f"{role}.{k}": v for role in ("actor", "critic") for k, v in {
        "use_dist_checkpointing": False, "dist_checkpointing_path": None}.items()},
    # verl's mini-batch shuffle of the Megatron workers
    "actor.shuffle": False, "critic.shuffle": False,
    # code data sources scored in a sandbox (verl's reward_model.sandbox_fusion)
    "reward.sandbox_fusion": {"url": None, "max_concurrent": 64, "memory_limit_mb": 1024},
    # multi-turn rollouts with tools (verl's actor_rollout_ref.rollout.multi_turn; rlhf/agent)
    "rollout.multi_turn": {"enable": False, "max_assistant_turns": None, "max_user_turns": None,
                           "max_parallel_calls": 1, "max_tool_response_length": 256,
                           "tool_response_truncate_side": "middle", "tool_config_path": None,
                           "interaction_config_path": None, "format": "hermes", "tool_timeout_s": 30.0,
                           "max_tokens_per_turn": None},
    # verl's rollout.engine_kwargs.sglang: extra sglang.Engine arguments
    "rollout.engine_kwargs": {"sglang": {}},
    # issue 40: verl's rollout correction, one-step off-policy
    "algorithm.rollout_correction": {"rollout_is": None, "rollout_is_threshold": 2.0, "rollout_rs": None,
                                     "rollout_rs_threshold": None, "bypass_mode": False, "loss_type": "ppo_clip",
                                     "rollout_is_batch_normalize": False},
    "trainer.one_step_off_policy": {"enable": False, "staleness": 1},
    # the distillation teacher's own grid (null: the trainer's)
    "distill.teacher.tensor_model_parallel_size": None, "distill.teacher.pipeline_model_parallel_size": None,
    # issue 40: verl's fully async (async_training, top level)
    "async_training": {"enable": False, "staleness_threshold": 0.1, "trigger_parameter_sync_step": 4,
                       "require_batches": 1, "partial_rollout": True, "partial_rollout_chunk_tokens": None,
                       "use_rollout_log_probs": True, "compute_prox_log_prob": False},
}
# defaults changed since the capture: key -> (captured value, new value); a recipe's own setting is kept
CHANGED_DEFAULTS = {
    "actor.optim.use_distributed_optimizer": (False, None),  # null: on when data-parallel size > 1
    "critic.optim.use_distributed_optimizer": (False, None),
    "reward.timeout_s": (None, 3.0),  # the seed's reward-model timeout
}
#: recipes captured after ADDED_KEYS were added (their fixtures already hold those keys)
CAPTURED_LATER = {"gspo_tiny_cpu", "cispo_tiny_cpu", "sapo_tiny_cpu", "gpg_tiny_cpu", "gmpo_tiny_cpu",
                  "clip_cov_tiny_cpu", "kl_cov_tiny_cpu", "remax_tiny_cpu", "opo_tiny_cpu", "grpo_passk_tiny_cpu",
                  "gpu_smoke", "opd_tiny_cpu", "calc_tool_tiny_cpu", "gsm8k_multiturn_qwen2_5_3b",
                  "moe_r3_tiny_cpu"}


@pytest.mark.parametrize("name", [None] + sorted(p.stem for p in FIXTURES.glob("*.yaml") if p.stem != "_base"))
def test_recipe_composes_to_the_captured_config(name):
    """Recipes on shared bases (recipes/_base/*.yaml) and presets (algorithm/*.yaml) compose to exactly the
    values captured before they were rewritten (`python -m rlhf.main recipe=NAME --cfg`).  Keys added since
    (ADDED_KEYS) come with their defaults and change nothing else."""
    before = yaml.safe_load((FIXTURES / f"{name or '_base'}.yaml").read_text())
    if before["critic"]["ppo_mini_batch_size"] != before["actor"]["ppo_mini_batch_size"]:
        no_critic = before["algorithm"]["name"] == "dpo" or before["algorithm"]["adv_estimator"] != "gae"
        assert before["critic"]["enable"] is None and no_critic  # only where no critic is trained
        before["critic"]["ppo_mini_batch_size"] = before["actor"]["ppo_mini_batch_size"]  # follows the actor now
    for key, default in ADDED_KEYS.items():
        *parents, leaf = key.split(".")
        node = before
        for part in parents:
            node = node[part]
        if name in CAPTURED_LATER and leaf in node:
            continue
        assert leaf not in node, key
        node[leaf] = copy.deepcopy(default)  # a later key may add to it (distill.teacher.*)
    for key, (was, now) in CHANGED_DEFAULTS.items():
        *parents, leaf = key.split(".")
        node = before
        for part in parents:
            node = node[part]
        if node[leaf] == was:
            node[leaf] = now
    assert yaml.safe_load(OmegaConf.to_yaml(compose_config([], recipe=name))) == before
    if name is not None:
        assert name in list_recipes()


def test_every_recipe_is_captured():
    assert sorted(list_recipes()) == sorted(p.stem for p in FIXTURES.glob("*.yaml") if p.stem != "_base")


def test_rollout_n_default_follows_the_estimator(tmp_path):
    """rollout.n defaults to 4 for estimators that compare the responses of a prompt, 1 otherwise; a recipe's
    or an override's value wins (also over a preset), and an explicit n < 2 with such an estimator is an error."""
    assert compose_config([]).rollout.n == 1
    assert compose_config(["algorithm.adv_estimator=grpo"]).rollout.n == 4
    assert compose_config(["algorithm=rloo"]).rollout.n == 4
    assert compose_config(["algorithm=reinforce_plus_plus"]).rollout.n == 1
    assert compose_config(["algorithm=grpo", "rollout.n=6"]).rollout.n == 6
    assert compose_config(["algorithm=grpo"], recipe="gsm8k_ppo_tiny_cpu").rollout.n == 2  # the recipe's
    with pytest.raises(ConfigValidationError, match=r"needs rollout.n >= 2 \(got 1\)"):
        validate_config(compose_config(["algorithm=grpo", "rollout.n=1"]))
    _write_recipe(tmp_path, "one", "rollout:\n  n: 1\n")
    with pytest.raises(ConfigValidationError, match="rollout.n >= 2"):
        validate_config(compose_config(["algorithm=grpo"], recipe="one", search_paths=[tmp_path]))


def test_algorithm_presets_compose():
    from rlhf.config import list_algorithms

    assert list_algorithms() == sorted(["ppo", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus",
                                        "reinforce_plus_plus_baseline", "dapo", "dpo"])
    c = compose_config(["algorithm=dr_grpo"], recipe="quickstart")  # the preset wins over the recipe
    assert (c.algorithm.adv_estimator, c.critic.enable, c.algorithm.norm_adv_by_std_in_grpo) == ("grpo", None, False)
    assert c.actor.loss_agg_mode == "seq-mean-token-sum-norm" and c.actor.optim.lr == 1e-4  # recipe's lr kept
    assert compose_config(["+algorithm=grpo"]) == compose_config(["algorithm=grpo"])
    assert compose_config(["algorithm=null"]) == compose_config([])  # no preset, the default
    with pytest.raises(ConfigKeyError) as ei:
        compose_config(["algorithm=grpoo"])
    assert "Unknown algorithm preset 'grpoo'" in str(ei.value) and ei.value.suggestions[0] == "grpo"


# --------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize("override,bad,suggestion", [
    ("trainer.totl_training_steps=3", "trainer.totl_training_steps", "trainer.total_training_steps"),
    ("actor.clip_ratoi=0.3", "actor.clip_ratoi", "actor.clip_ratio"),
    ("actor.optim.lrr=1e-5", "actor.optim.lrr", "actor.optim.lr"),
    ("trainr.seed=3", "trainr.seed", "trainer.seed"),  # the misspelt section with its valid rest
    ("actor_rollout_ref.actor.clip_ratoi=0.3", "actor_rollout_ref.actor.clip_ratoi",
     "actor_rollout_ref.actor.clip_ratio"),  # verl's key: the nearest keys in verl's words
    ("actor.kl_coef=0.1", "actor.kl_coef", "algorithm.kl_ctrl.kl_coef"),
    ("+trainer.totl_training_steps=3", "trainer.totl_training_steps", "trainer.total_training_steps"),
])
def test_unknown_key_on_command_line(override, bad, suggestion):
    with pytest.raises(ConfigKeyError) as ei:
        compose_config([override], recipe="quickstart")
    e = ei.value
    assert isinstance(e, ValueError) and e.key == bad and suggestion in e.suggestions
    msg = str(e)
    assert bad in msg and suggestion in msg and override in msg and "Did you mean" in msg
    assert len(msg.splitlines()) <= 4


def _write_recipe(root: Path, name: str, body: str) -> Path:
    (root / "recipe").mkdir(parents=True, exist_ok=True)
    p = root / "recipe" / f"{name}.yaml"
    p.write_text("# @package _global_\n" + textwrap.dedent(body))
    return p


def test_unknown_key_in_recipe_file(tmp_path):
    _write_recipe(tmp_path, "typo", """
        trainer:
          totl_training_steps: 5
    """)
    with pytest.raises(ConfigKeyError) as ei:
        compose_config([], recipe="typo", search_paths=[tmp_path])
    msg = str(ei.value)
    assert "trainer.totl_training_steps" in msg and "trainer.total_training_steps" in msg
    assert "recipe/typo" in msg
    # the same through a hydra.searchpath override (what a command line can pass)
    with pytest.raises(ConfigKeyError, match="trainer.total_training_steps"):
        compose_config([f"hydra.searchpath=[file://{tmp_path}]", "recipe=typo"])


def test_unknown_nested_key_in_recipe_file(tmp_path):
    _write_recipe(tmp_path, "nested", """
        actor:
          optim:
            lrr: 1.0e-5
    """)
    with pytest.raises(ConfigKeyError) as ei:
        compose_config([], recipe="nested", search_paths=[tmp_path])
    assert ei.value.key == "actor.optim.lrr" and "actor.optim.lr" in ei.value.suggestions


def test_user_recipe_from_search_path(tmp_path):
    _write_recipe(tmp_path, "mine", """
        trainer:
          total_training_steps: 7
    """)
    assert "mine" in list_recipes([tmp_path])
    assert compose_config([], recipe="mine", search_paths=[tmp_path]).trainer.total_training_steps == 7


def test_user_recipe_on_a_shared_base(tmp_path):
    """A recipe of your own can start from the built-in bases and presets (docs/api.md)."""
    _write_recipe(tmp_path, "my_grpo", """
        defaults:
          - _base/tiny_cpu
          - /algorithm/grpo
          - _self_
        rollout:
          n: 8
    """)
    cfg = compose_config([], recipe="my_grpo", search_paths=[tmp_path])
    assert (cfg.model.path, cfg.actor.optim.lr, cfg.algorithm.adv_estimator, cfg.rollout.n) == \
        ("tiny://quickstart", 2e-4, "grpo", 8)
    validate_config(cfg, world_size=1)


def test_unknown_recipe():
    with pytest.raises(ConfigKeyError) as ei:
        compose_config([], recipe="quickstrat")
    msg = str(ei.value)
    assert "quickstrat" in msg and "quickstart" in ei.value.suggestions and "gsm8k_ppo_qwen2_7b" in msg


def test_wrong_type_and_malformed_overrides():
    with pytest.raises(ConfigValidationError, match="trainer.total_epochs"):
        compose_config(["trainer.total_epochs=abc"])
    with pytest.raises(ConfigError, match="parse"):
        compose_config(["trainer.total_epochs=="])
    with pytest.raises(ConfigError, match="cannot be deleted"):
        compose_config(["~trainer.seed"])
    with pytest.raises(ConfigError, match="conflicts"):
        compose_config(["recipe=gsm8k_ppo_tiny_cpu"], recipe="quickstart")


def test_bad_interpolation_in_recipe(tmp_path):
    _write_recipe(tmp_path, "interp_typo", """
        trainer:
          default_local_dir: outputs/${trainer.experimet_name}
    """)
    with pytest.raises(ConfigValidationError) as ei:
        compose_config([], recipe="interp_typo", search_paths=[tmp_path])
    assert "trainer.experiment_name" in str(ei.value) and "trainer.default_local_dir" in str(ei.value)


def test_schema_keys():
    assert "total_training_steps" in schema_keys("trainer")
    assert schema_keys("actor.optim")[0] == "lr"
    with pytest.raises(ConfigKeyError):
        schema_keys("trainr")


# --------------------------------------------------------------------------- semantic validation


@pytest.fixture(scope="module")
def quickstart_cfg():
    return compose_config([], recipe="quickstart")


@pytest.mark.parametrize("overrides,world,expected", [
    ([("rollout.mode", 'hybrid')], None, ["rollout.mode='hybrid'", "colocated", "disaggregated"]),
    ([("algorithm.adv_estimator", 'gea')], None, ["algorithm.adv_estimator='gea'", "algorithm.adv_estimator=gae"]),
    ([("actor.loss_agg_mode", 'token_mean')], None, ["actor.loss_agg_mode", "token-mean"]),
    ([("trainer.resume_mode", 'resume')], None, ["trainer.resume_mode='resume'", "resume_path"]),
    ([("trainer.resume_mode", 'resume_path')], None, ["trainer.resume_from_path=<run>/checkpoints/global_step_N"]),
    ([("trainer.resume_mode", 'disable'), ("trainer.resume_from_path", '/ckpt/x')], None,
     ["ignored with trainer.resume_mode=disable", "trainer.resume_mode=resume_path"]),
    ([("actor.ppo_mini_batch_size", 3)], None, ["actor.ppo_mini_batch_size=3 does not divide", "train_batch_size=16"]),
    ([("critic.ppo_mini_batch_size", 32)], None, ["critic.ppo_mini_batch_size=32 is larger"]),
    ([("critic.enable", False)], None, ["needs a critic"]),
    ([("algorithm.adv_estimator", 'grpo'), ("rollout.n", 1)], None, ["rollout.n >= 2"]),
    ([("trainer.save_freq", 0)], None, ["trainer.save_freq=0", "-1"]),
    ([("trainer.logger", ['console', 'wandbb'])], None, ["trainer.logger[1]='wandbb'", "trainer.logger[1]=wandb?"]),
    ([("actor.policy_loss.loss_mode", 'gspo2')], None, ["actor.policy_loss.loss_mode='gspo2'", "loss_mode=gspo?"]),
    ([("actor.policy_loss.clip_cov_lb", 6.0)], None, ["clip_cov_lb=6.0 is above actor.policy_loss.clip_cov_ub=5.0"]),
    ([("actor.policy_loss.kl_cov_ratio", 0.0)], None, ["actor.policy_loss.kl_cov_ratio=0.0 must be in (0, 1]"]),
    ([("actor.tau_neg", 0.0)], None, ["actor.tau_neg=0.0 must be > 0"]),
    ([("actor.loss_scale_factor", -1.0)], None, ["actor.loss_scale_factor=-1.0 must be > 0 (or null)"]),
    ([("algorithm.adv_estimator", 'grpo_passk'), ("rollout.n", 1)], None, ["grpo_passk", "rollout.n >= 2"]),
    ([("algorithm.adv_estimator", 'opo'), ("rollout.n", 1)], None, ["opo", "rollout.n >= 2"]),
    ([("algorithm.adv_estimator", 'grpo'), ("trainer.critic_warmup", 2)], None, ["trainer.critic_warmup=2",
                                                                                 "no critic"]),
    ([("trainer.n_gpus_per_node", 4), ("trainer.nnodes", 1)], 2, ["= 4 but the job has 2 trainer processes"]),
    ([("trainer.n_gpus_per_node", 3), ("trainer.nnodes", 1), ("parallel.tensor_model_parallel_size", 2)], None,
     ["does not divide the 3 trainer GPUs of trainer.nnodes=1 x trainer.n_gpus_per_node=3; set "
      "trainer.n_gpus_per_node=4 (4 trainer GPUs, a multiple of 2)"]),
    ([("parallel.tensor_model_parallel_size", 2)], 3, ["does not divide the 3 trainer processes; launch a multiple"]),
    ([("reward.gsm8k.method", 'loose')], None, ["reward.gsm8k.method='loose' is not one of [strict, flexible]"]),
    ([("data.truncation", 'cut')], None, ["data.truncation='cut' is not one of [error, left, right, middle]"]),
    ([("rollout.top_p", 0)], None, ["rollout.top_p"]),
    ([("rollout.mem_fraction_static", 1.5)], None, ["rollout.mem_fraction_static"]),
    ([("model.dtype", 'fp16')], None, ["model.dtype"]),
    ([("parallel.recompute", 'partial')], None, ["parallel.recompute"]),
    ([("parallel.virtual_pipeline_model_parallel_size", 2)], None, ["pipeline_model_parallel_size > 1"]),
    ([("parallel.tensor_model_parallel_size", 2)], 3, ["does not divide the 3 trainer processes"]),
    ([("actor.ppo_mini_batch_size", 1), ("critic.ppo_mini_batch_size", 16), ("rollout.n", 1)], 2,
     ["actor.ppo_mini_batch_size=1 x rollout.n=1", "data-parallel size 2"]),
    ([("algorithm.kl_ctrl.type", 'pid')], None, ["algorithm.kl_ctrl.type"]),
    ([("actor.use_kl_loss", True), ("actor.kl_loss_type", 'low_var')], None, ["actor.kl_loss_type"]),
    ([("reward.custom_reward_function.path", '/nonexistent/reward.py')], None, ["is not a file"]),
])
def test_semantic_validation(overrides, world, expected):
    """A bad value, given as a command-line override, fails while composing (a type or a choice: the schema's
    field types) or validating (ranges, rules across sections), naming the key, the value and the fix."""
    with pytest.raises(ConfigValidationError) as ei:
        cfg = compose_config([f"{k}={format_value(v)}" for k, v in overrides], recipe="quickstart")
        validate_config(cfg, world_size=world)
    msg = str(ei.value)
    for s in expected:
        assert s in msg, f"{s!r} not in:\n{msg}"


def test_context_length_checked_against_local_model(quickstart_cfg, tmp_path):
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 64}')
    cfg = copy.deepcopy(quickstart_cfg)
    OmegaConf.update(cfg, "model.path", str(tmp_path))
    with pytest.raises(ConfigValidationError, match="max_position_embeddings=64"):
        validate_config(cfg)
    OmegaConf.update(cfg, "data.max_prompt_length", 40)
    OmegaConf.update(cfg, "data.max_response_length", 24)
    validate_config(cfg)


def test_all_problems_reported_together():
    with pytest.raises(ConfigValidationError) as ei:
        validate_config(compose_config(["rollout.mode=x", "trainer.resume_mode=y", "actor.loss_agg_mode=z"]))
    assert len(ei.value.problems) == 3


def test_every_kind_of_problem_reported_together(capsys):
    """Bad types and choices (found while composing) come with the range and cross-section problems."""
    bad = ["rollout.mode=hybrid", "trainer.total_epochs=abc", "trainer.logger=[console,wandbb]", "rollout.top_p=0",
           "actor.optim.adam_beta1=1", "algorithm.adv_estimator=gea", "actor.ppo_mini_batch_size=3",
           "parallel.recompute=partial"]
    with pytest.raises(ConfigValidationError) as ei:
        validate_config(compose_config(bad, recipe="quickstart"))
    msg = str(ei.value)
    assert len(ei.value.problems) == 8, msg
    for s in ["rollout.mode='hybrid' is not one of [colocated, disaggregated]; colocated: engines share",
              "trainer.total_epochs: Value 'abc' of type 'str' could not be converted to Integer",
              "trainer.logger[1]='wandbb' is not one of [console, tensorboard, wandb, mlflow]",
              "rollout.top_p=0.0 must be in (0, 1]", "actor.optim.adam_beta1=1.0 must be in [0, 1)",
              "algorithm.adv_estimator='gea' is not one of [", "(did you mean algorithm.adv_estimator=gae?)",
              "actor.ppo_mini_batch_size=3 does not divide data.train_batch_size=16",
              "parallel.recompute='partial' is not one of [null, full, selective]"]:
        assert s in msg, f"{s!r} not in:\n{msg}"
    assert main(["recipe=quickstart", *bad]) == 2
    assert "Invalid config (8 problems)" in capsys.readouterr().err


def test_bad_choice_in_recipe_file(tmp_path):
    _write_recipe(tmp_path, "badmode", "rollout:\n  mode: hybrid\n")
    with pytest.raises(ConfigValidationError) as ei:
        compose_config([], recipe="badmode", search_paths=[tmp_path])
    msg = str(ei.value)
    assert "rollout.mode='hybrid' is not one of [colocated, disaggregated]" in msg and "recipe/badmode" in msg


def test_a_bad_choice_names_where_it_came_from(tmp_path):
    """OmegaConf's check of an Enum field, worded once for every source: command line, config file, recipe."""
    (tmp_path / "run.yaml").write_text("rollout:\n  mode: hybrid\n")
    _write_recipe(tmp_path, "badmode", "rollout:\n  mode: hybrid\n")
    for kwargs, source in [(dict(overrides=["rollout.mode=hybrid"]), "command-line override 'rollout.mode=hybrid'"),
                           (dict(config_file=tmp_path / "run.yaml"), f"config file {tmp_path / 'run.yaml'}"),
                           (dict(recipe="badmode", search_paths=[tmp_path]), "in recipe/badmode.yaml")]:
        with pytest.raises(ConfigValidationError) as ei:
            compose_config(**kwargs)
        [problem] = ei.value.problems
        assert problem.startswith("rollout.mode='hybrid' is not one of [colocated, disaggregated]; colocated: ")
        assert problem.endswith(f"({source})"), problem


def test_choices_read_as_strings_and_match_the_algorithms():
    from rlhf.algorithms import ADV_ESTIMATOR_REGISTRY, LOSS_AGG_MODES, kl_penalty
    from rlhf.config.choices import GROUP_ESTIMATORS, KLEstimator, LossAggMode

    cfg = compose_config([], recipe="gsm8k_ppo_qwen2_7b")
    assert cfg.rollout.mode == "colocated" and f"{cfg.model.dtype}" == "bfloat16" and isinstance(cfg.model.dtype, str)
    assert {"bfloat16": 1}[cfg.rollout.dtype] == 1 and list(cfg.trainer.logger) == ["console", "tensorboard"]
    import pickle

    assert type(pickle.loads(pickle.dumps(cfg.rollout.dtype))) is str  # e.g. sent to a Ray actor
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert tuple(LossAggMode.__members__) == tuple(LOSS_AGG_MODES)
    import torch

    lp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    for mode in KLEstimator:  # every choice is accepted by the estimator itself
        assert torch.isfinite(kl_penalty(lp, ref, str(mode))).all()
    with pytest.raises(Exception):
        kl_penalty(lp, ref, "k4")
    assert set(GROUP_ESTIMATORS) <= set(ADV_ESTIMATOR_REGISTRY)


def test_torch_free_name_lists_equal_the_algorithm_registries():
    """The estimator / policy-loss names are declared once, torch-free, in rlhf.algorithms.registry (rlhf.config
    asks it); the built-ins registered under exactly those names.  The supported architectures likewise."""
    from rlhf.algorithms import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY
    from rlhf.algorithms.registry import (
        GROUP_ESTIMATORS,
        AdvantageEstimator,
        PolicyLossMode,
        adv_estimator_names,
        policy_loss_names,
    )
    from rlhf.config import choices
    from rlhf.preflight import SUPPORTED_ARCHITECTURES
    from parallel.model_config import SUPPORTED_ARCHITECTURES as MCORE_ARCHITECTURES

    assert adv_estimator_names() == sorted(ADV_ESTIMATOR_REGISTRY) == sorted(e.value for e in AdvantageEstimator)
    assert policy_loss_names() == sorted(POLICY_LOSS_REGISTRY) == sorted(m.value for m in PolicyLossMode)
    assert choices.GROUP_ESTIMATORS is GROUP_ESTIMATORS
    assert not hasattr(choices, "ADV_ESTIMATORS") and not hasattr(choices, "POLICY_LOSS_MODES")  # no copies
    assert set(GROUP_ESTIMATORS) == {"grpo", "rloo", "reinforce_plus_plus_baseline", "grpo_vectorized",
                                     "rloo_vectorized", "opo", "gpg", "grpo_passk"}
    assert tuple(SUPPORTED_ARCHITECTURES) == tuple(MCORE_ARCHITECTURES)


def test_validation_asks_the_registry_for_run_time_names(quickstart_cfg):
    """A loss mode / estimator registered at run time validates; an unknown one gets the nearest name."""
    from rlhf.algorithms import POLICY_LOSS_REGISTRY, register_policy_loss

    cfg = copy.deepcopy(quickstart_cfg)
    OmegaConf.update(cfg, "actor.policy_loss.loss_mode", "my_test_loss")
    with pytest.raises(ConfigValidationError, match="actor.policy_loss.loss_mode='my_test_loss' is not one of"):
        validate_config(cfg, world_size=1)
    try:
        register_policy_loss("my_test_loss")(lambda *a, **k: None)
        validate_config(cfg, world_size=1)
        OmegaConf.update(cfg, "actor.policy_loss.loss_mode", "my_test_los")
        with pytest.raises(ConfigValidationError, match=r"did you mean actor.policy_loss.loss_mode=my_test_loss\?"):
            validate_config(cfg, world_size=1)
    finally:
        POLICY_LOSS_REGISTRY.pop("my_test_loss", None)


def test_policy_loss_modes_and_estimators_compose_and_validate(quickstart_cfg):
    """Every registered loss mode (also with a '-' spelling) and the new estimators validate;
    the group estimators get rollout.n=4 by default, remax and gae keep 1."""
    from rlhf.algorithms.registry import PolicyLossMode

    for mode in (m.value for m in PolicyLossMode):
        # bypass_mode goes with algorithm.rollout_correction.bypass_mode (refused alone: rlhf.config.validate)
        extra = ["algorithm.rollout_correction.bypass_mode=true"] if mode == "bypass_mode" else []
        cfg = compose_config([f"actor.policy_loss.loss_mode={mode}", *extra], recipe="quickstart")
        validate_config(cfg, world_size=1)
    cfg = compose_config(["actor.policy_loss.loss_mode=clip-cov"], recipe="quickstart")
    validate_config(cfg, world_size=1)
    for est, n in [("grpo_passk", 4), ("opo", 4), ("gpg", 4), ("grpo_vectorized", 4), ("rloo_vectorized", 4),
                   ("remax", 1), ("gae", 1)]:
        cfg = compose_config([f"algorithm.adv_estimator={est}"])
        assert cfg.rollout.n == n, est
        validate_config(cfg, world_size=1)


def test_new_schema_keys_have_verl_defaults():
    c = compose_config([])
    assert dict(c.actor.policy_loss) == {"loss_mode": "vanilla", "clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0,
                                         "clip_cov_ub": 5.0, "kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1}
    assert (c.actor.tau_pos, c.actor.tau_neg, c.actor.loss_scale_factor) == (1.0, 1.05, None)
    assert (c.reward.exclude_unscorable, c.algorithm.overlong_filter) == (True, False)
    assert (c.reward.gsm8k.method, c.reward.gsm8k.format_score) == ("strict", 0.0)
    assert (c.trainer.critic_warmup, c.trainer.log_val_generations, c.trainer.n_gpus_per_node) == (0, 0, None)


def test_section_rules_run_in_post_init():
    from rlhf.config.schema import RolloutConfig, TrainerConfig

    with pytest.raises(ConfigValidationError, match=r"top_p=0 must be in \(0, 1\]"):
        RolloutConfig(top_p=0)
    with pytest.raises(ConfigValidationError, match="resume_from_path=<run>/checkpoints/global_step_N"):
        TrainerConfig(resume_mode="resume_path")
    assert RolloutConfig(n=3).n == 3


def test_one_optim_config():
    """actor.optim / critic.optim are the OptimConfig that parallel.optim.build_train_state takes."""
    from parallel.optim import OptimConfig as MCoreOptimConfig
    from parallel.optim_config import OptimConfig

    cfg = compose_config(["actor.optim.lr_decay_style=cosine", "actor.optim.lr_decay_steps=100"], recipe="quickstart")
    optim = OmegaConf.to_object(cfg).actor.optim
    assert MCoreOptimConfig is OptimConfig and type(optim) is OptimConfig
    assert (optim.lr, optim.lr_decay_style, optim.lr_decay_steps, optim.use_distributed_optimizer) == \
        (1e-4, "cosine", 100, None)  # null: the distributed optimizer exactly when data-parallel size > 1
    assert OptimConfig().use_distributed_optimizer is None and OmegaConf.to_object(cfg).critic.optim.lr == 1e-3
    assert optim.breaker.grad_norm == 100.0 and optim.max_consecutive_skipped_steps == 10
    with pytest.raises(ValueError, match="min_lr=0.5 is above lr=0.1"):
        OptimConfig(lr=0.1, min_lr=0.5)
    with pytest.raises(ValueError):
        OptimConfig(lr_decay_style="exponential")
    with pytest.raises(ConfigValidationError, match="actor.optim.lr_decay_style='exp' is not one of"):
        compose_config(["actor.optim.lr_decay_style=exp"])


def test_composing_imports_neither_torch_nor_megatron():
    """`python -m rlhf.main --cfg` stays fast: composing (CLI, API module, presets, recipes) loads no torch."""
    code = textwrap.dedent("""
        import sys
        import rlhf.api, rlhf.main
        from rlhf.config import compose_config
        compose_config(["algorithm=dapo"], recipe="dapo_qwen2_7b")
        bad = [m for m in sys.modules if m.split(".")[0] in ("torch", "megatron", "sglang", "ray")]
        assert not bad, bad[:5]
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_no_import_cycles_through_the_entry_points_and_config():
    """No module of rlhf.config, rlhf.main, rlhf.api, rlhf.cli, rlhf.launch_env is on an import cycle
    (imports inside functions count too)."""
    import ast

    def module_of(path: Path) -> str:
        rel = path.relative_to(REPO).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        return ".".join(parts)

    graph: dict[str, set] = {}
    for path in (REPO / "rlhf").rglob("*.py"):
        mod, deps = module_of(path), set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.update((node.module, f"{node.module}.{a.name}") for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update((a.name, a.name) for a in node.names)
        graph[mod] = deps
    # `from pkg import submodule` depends on the submodule (a package's lazy __getattr__ is not run for it)
    graph = {m: {sub if sub in graph else pkg for pkg, sub in ds} for m, ds in graph.items()}
    graph = {m: {d for d in ds if d in graph and d != m} for m, ds in graph.items()}
    ours = [m for m in graph if m.startswith("rlhf.config") or m in ("rlhf.main", "rlhf.api", "rlhf.cli",
                                                                      "rlhf.launch_env")]
    for start in ours:
        stack, seen = [(start, [start])], set()
        while stack:
            m, path = stack.pop()
            for d in graph[m]:
                assert d != start, f"import cycle: {' -> '.join(path + [d])}"
                if d not in seen:
                    seen.add(d)
                    stack.append((d, path + [d]))


def test_every_registered_estimator_validates(quickstart_cfg):
    from rlhf.algorithms import AdvantageEstimator

    for est in AdvantageEstimator:
        cfg = copy.deepcopy(quickstart_cfg)
        OmegaConf.update(cfg, "algorithm.adv_estimator", est.value)
        OmegaConf.update(cfg, "rollout.n", 4)
        validate_config(cfg, world_size=1)


# --------------------------------------------------------------------------- rlhf.main


def test_main_bad_key_subprocess_exits_2_with_short_message():
    r = subprocess.run([sys.executable, "-m", "rlhf.main", "recipe=quickstart", "trainer.totl_training_steps=3"],
                       cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "trainer.totl_training_steps" in r.stderr and "trainer.total_training_steps" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout and len(r.stderr.strip().splitlines()) <= 6


def test_main_bad_key_other_ranks_are_quiet(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["recipe=quickstart", "trainer.totl_training_steps=3"]) == 2
    assert capsys.readouterr().err == ""


def test_main_validation_error_exits_2(capsys):
    assert main(["recipe=quickstart", "rollout.mode=hybrid"]) == 2
    err = capsys.readouterr().err
    assert "rollout.mode='hybrid'" in err and "Traceback" not in err


def test_main_checks_world_size_from_launcher(monkeypatch, capsys):
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "3")
    assert main(["recipe=gsm8k_ppo_tiny_cpu", "--cfg"]) == 2
    assert "does not divide the 3 trainer processes" in capsys.readouterr().err


def test_main_help_lists_recipes(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in RECIPES:
        assert name in out


def test_main_cfg_prints_resolved_yaml(capsys):
    assert main(["recipe=quickstart", "trainer.total_training_steps=4", "--cfg"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["trainer"]["total_training_steps"] == 4 and cfg["model"]["path"] == "tiny://quickstart"


def test_main_usage_errors(capsys):
    assert main(["quickstart"]) == 2
    assert "recipe=quickstart" in capsys.readouterr().err
    assert main(["--bogus"]) == 2
    assert parse_args(["--recipe", "quickstart", "a.b=1"]) == (
        {"help": False, "cfg": False, "config_file": None, "config_dirs": []}, ["recipe=quickstart", "a.b=1"])


def test_main_runs_trainer_with_composed_config(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    seen = {}
    fake = types.ModuleType("rlhf.trainer")
    fake.run = lambda cfg: seen.setdefault("cfg", cfg) and {"ok": True}
    monkeypatch.setitem(sys.modules, "rlhf.trainer", fake)
    monkeypatch.setattr(rlhf, "trainer", fake, raising=False)
    assert main(["recipe=quickstart", "trainer.total_training_steps=2"]) == 0
    assert seen["cfg"].trainer.total_training_steps == 2 and seen["cfg"].trainer.experiment_name == "quickstart"
    written = OmegaConf.load(tmp_path / "outputs" / "quickstart" / "config.yaml")  # the run's config, for its outputs
    assert written.trainer.total_training_steps == 2 and written.model.path == "tiny://quickstart"

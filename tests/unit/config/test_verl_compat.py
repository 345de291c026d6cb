"""verl users at home: verl's key layout on the command line and in YAML files, Hydra's standard options, and
the config checks that need files (data paths, model config.json) before anything is downloaded.  CPU, fast."""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from rlhf.config import ConfigKeyError, ConfigValidationError, compose_config, validate_config
from rlhf.data.refs import parse_data_ref, parse_model_ref
from rlhf.main import UsageError, find_config_file, main, parse_args

from tests.support.paths import REPO
VERL_MIRROR = Path("/work/.mirror/volcengine+verl/repo")

# The overrides of verl's GSM8K PPO example for Megatron (examples/ppo_trainer/run_qwen2-7b_math_gsm8k_megatron.sh),
# run there as `python3 -m verl.trainer.main_ppo --config-path=./config --config-name='ppo_megatron_trainer' ...`.
# Only the data paths are ours ({train} / {test}); the keys and values are verl's, as a shell passes them.
VERL_GSM8K_PPO = """
    algorithm.adv_estimator=gae
    data.train_files={train}
    data.val_files={test}
    data.train_batch_size=1024
    data.max_prompt_length=1024
    data.max_response_length=512
    data.filter_overlong_prompts=True
    data.truncation=error
    actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=256
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4
    actor_rollout_ref.rollout.tensor_model_parallel_size=4
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4
    actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2
    critic.optim.lr=1e-5
    critic.model.path=Qwen/Qwen2-7B-Critic
    critic.ppo_micro_batch_size_per_gpu=4
    algorithm.use_kl_in_reward=False
    trainer.critic_warmup=0
    trainer.logger=["console","wandb"]
    trainer.project_name=verl_ppo_gsm8k_math_examples
    trainer.experiment_name=qwen2_7b_megatron
    trainer.n_gpus_per_node=8
    trainer.nnodes=1
    trainer.save_freq=20
    trainer.test_freq=5
    trainer.total_epochs=100
"""
# verl's quickstart (docs/start/quickstart.rst): a string logger, the reference's micro batch, val_before_train
VERL_QUICKSTART = """
    data.train_files={train}
    data.val_files={test}
    data.train_batch_size=256
    data.max_prompt_length=512
    data.max_response_length=512
    actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=64
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4
    critic.optim.lr=1e-5
    critic.model.path=Qwen/Qwen2.5-0.5B-Instruct
    critic.ppo_micro_batch_size_per_gpu=4
    algorithm.kl_ctrl.kl_coef=0.001
    trainer.logger=console
    trainer.val_before_train=False
    trainer.n_gpus_per_node=1
    trainer.nnodes=1
    trainer.save_freq=10
    trainer.test_freq=10
    trainer.total_epochs=15
"""


# verl's current canonical PPO example (examples/ppo_trainer/run_qwen3_8b_megatron.sh, its arrays as bash expands
# them with the defaults), with token-budget (dynamic) micro batches
VERL_PPO_QWEN3_MEGATRON = """
    algorithm.adv_estimator=gae
    data.train_files={train}
    data.val_files={test}
    data.train_batch_size=1024
    data.max_prompt_length=1024
    data.max_response_length=2048
    data.filter_overlong_prompts=True
    data.truncation=error
    actor_rollout_ref.model.path=Qwen/Qwen3-8B
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=256
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.tensor_model_parallel_size=2
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.n=1
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24576
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=24576
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2
    actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2
    critic.model.path=Qwen/Qwen3-8B
    critic.model.use_remove_padding=True
    critic.optim.lr=1e-5
    critic.use_dynamic_bsz=True
    critic.ppo_max_token_len_per_gpu=24576
    critic.megatron.tensor_model_parallel_size=2
    critic.megatron.pipeline_model_parallel_size=2
    trainer.balance_batch=True
    trainer.critic_warmup=0
    trainer.logger=["console","wandb"]
    trainer.project_name=verl_ppo_gsm8k_math
    trainer.experiment_name=qwen3_8b_vllm_megatron
    trainer.n_gpus_per_node=8
    trainer.nnodes=1
    trainer.save_freq=20
    trainer.test_freq=5
    trainer.total_epochs=15
    model_engine=megatron
    ray_kwargs.ray_init.runtime_env.py_executable=null
"""


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(k, raising=False)


@pytest.fixture
def gsm8k(tmp_path):
    """Two GSM8K-style files and the two data-file lists of verl's example (gsm8k + math)."""
    rows = [{"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}]
    files = {}
    for name in ("gsm8k_train", "math_train", "gsm8k_test", "math_test"):
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"train": f"['{files['gsm8k_train']}', '{files['math_train']}']",
            "test": f"['{files['gsm8k_test']}', '{files['math_test']}']", "files": files}


def _lines(template: str, **paths) -> list[str]:
    return [line.strip().format(**paths) for line in template.strip().splitlines()]


def _env() -> dict:
    # verl's examples log to wandb; without credentials a run is refused at --cfg unless W&B is offline
    return {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline"}


def _check_gsm8k_ppo(c, files) -> None:
    assert list(c.data.train_files) == [str(files["gsm8k_train"]), str(files["math_train"])]
    assert (c.data.train_batch_size, c.data.max_prompt_length, c.data.filter_overlong_prompts, c.data.truncation) == \
        (1024, 1024, True, "error")
    assert (c.model.path, c.model.critic_path) == ("Qwen/Qwen2-7B-Instruct", "Qwen/Qwen2-7B-Critic")  # not the actor's
    assert (c.parallel.tensor_model_parallel_size, c.parallel.pipeline_model_parallel_size) == (2, 2)
    assert (c.actor.optim.lr, c.actor.ppo_mini_batch_size, c.actor.ppo_micro_batch_size_per_gpu) == (1e-6, 256, 4)
    assert (c.actor.log_prob_micro_batch_size_per_gpu, c.actor.use_kl_loss) == (4, False)
    assert (c.rollout.name, c.rollout.tensor_model_parallel_size, c.rollout.mem_fraction_static) == ("sglang", 4, 0.4)
    assert (c.critic.optim.lr, c.critic.ppo_micro_batch_size_per_gpu, c.critic.ppo_mini_batch_size) == (1e-5, 4, 256)
    assert (c.algorithm.adv_estimator, c.algorithm.use_kl_in_reward) == ("gae", False)
    assert list(c.trainer.logger) == ["console", "wandb"] and c.trainer.critic_warmup == 0
    assert (c.trainer.project_name, c.trainer.experiment_name) == ("verl_ppo_gsm8k_math_examples", "qwen2_7b_megatron")
    assert (c.trainer.n_gpus_per_node, c.trainer.nnodes, c.trainer.save_freq, c.trainer.test_freq,
            c.trainer.total_epochs) == (8, 1, 20, 5, 100)


# --------------------------------------------------------------------------- verl command lines


def test_verl_gsm8k_ppo_command_line_runs_through_cfg(gsm8k):
    """verl's own example command line, only the program and the data paths changed, passes `--cfg` (rc 0)
    with every value where verl puts it; the data-parallel layout is checked against n_gpus_per_node x nnodes."""
    args = ["--config-path=./config", "--config-name=ppo_megatron_trainer", "--cfg", "job",
            *_lines(VERL_GSM8K_PPO, **gsm8k)]
    r = subprocess.run([sys.executable, "-m", "rlhf.main", *args], cwd=REPO, env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "vllm: the rollout engine here is SGLang" in r.stderr
    _check_gsm8k_ppo(OmegaConf.create(yaml.safe_load(r.stdout)), gsm8k["files"])
    # with 16 GPUs declared the 256 x 1 mini batch still splits over DP 4; a 6-GPU job does not divide TP2 x PP2
    bad = [*args[4:], "trainer.n_gpus_per_node=6"]
    assert main(["--cfg", *bad]) == 2


def test_verl_quickstart_command_line(gsm8k, capsys):
    assert main(["--cfg", *_lines(VERL_QUICKSTART, **gsm8k)]) == 0
    c = OmegaConf.create(yaml.safe_load(capsys.readouterr().out))
    assert list(c.trainer.logger) == ["console"] and c.trainer.val_before_train is False
    assert c.actor.log_prob_micro_batch_size_per_gpu == 8 and c.algorithm.kl_ctrl.kl_coef == 0.001
    assert c.model.critic_path == "Qwen/Qwen2.5-0.5B-Instruct" and c.rollout.mem_fraction_static == 0.4


def test_verl_current_ppo_example(gsm8k, capsys, caplog):
    """verl's current PPO example runs through --cfg unchanged: its token-budget micro batches (use_dynamic_bsz)
    are ours too; its no-effect keys are named in a warning."""
    lines = _lines(VERL_PPO_QWEN3_MEGATRON, **gsm8k)
    with caplog.at_level("WARNING", logger="rlhf.config"):
        assert main(["--cfg", *lines]) == 0, capsys.readouterr().err
    c = OmegaConf.create(yaml.safe_load(capsys.readouterr().out))
    assert (c.parallel.tensor_model_parallel_size, c.parallel.pipeline_model_parallel_size) == (2, 2)
    assert (c.rollout.tensor_model_parallel_size, c.rollout.mem_fraction_static, c.rollout.n) == (2, 0.6, 1)
    assert (c.data.max_response_length, c.actor.entropy_coeff, c.model.critic_path) == (2048, 0.0, "Qwen/Qwen3-8B")
    assert (c.actor.use_dynamic_bsz, c.actor.ppo_max_token_len_per_gpu, c.actor.log_prob_max_token_len_per_gpu,
            c.critic.use_dynamic_bsz, c.critic.ppo_max_token_len_per_gpu) == (True, 24576, 24576, True, 24576)
    warned = "\n".join(r.getMessage() for r in caplog.records)
    for key in ("model_engine", "trainer.balance_batch", "ray_kwargs.ray_init.runtime_env.py_executable",
                "critic.model.use_remove_padding", "actor_rollout_ref.ref.log_prob_use_dynamic_bsz"):
        assert key in warned, key
    assert "actor_rollout_ref.actor.ppo_max_token_len_per_gpu" not in warned


def _nest(lines: list[str]) -> dict:
    """key=value lines -> the nested YAML mapping verl's config files use."""
    out: dict = {}
    for line in lines:
        key, value = line.split("=", 1)
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    return out


def test_the_same_keys_in_a_verl_style_yaml(gsm8k, tmp_path, capsys):
    """The example's keys in a verl-style YAML (`defaults: [ppo_megatron_trainer, _self_]`, nested keys),
    read with --config-path/--config-name or --config, give the command line's config under the same base name
    (verl's defaults for ppo_megatron_trainer); the command line wins."""
    body = {"defaults": ["ppo_megatron_trainer", "_self_"], **_nest(_lines(VERL_GSM8K_PPO, **gsm8k))}
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "my_ppo.yaml").write_text(yaml.safe_dump(body))
    assert main(["--cfg", "--config-name=ppo_megatron_trainer", *_lines(VERL_GSM8K_PPO, **gsm8k)]) == 0
    from_cli = capsys.readouterr().out
    assert main(["--config-path", str(tmp_path / "conf"), "--config-name", "my_ppo", "--cfg"]) == 0
    assert capsys.readouterr().out == from_cli
    _, _ = parse_args(["-cp", str(tmp_path / "conf"), "-cn", "my_ppo.yaml"])
    cfg = compose_config(["trainer.total_epochs=3"], config_file=tmp_path / "conf" / "my_ppo.yaml")
    _check_gsm8k_ppo(OmegaConf.merge(cfg, {"trainer": {"total_epochs": 100}}), gsm8k["files"])
    assert cfg.trainer.total_epochs == 3


def test_verl_yaml_interpolations_defaults_and_reward_model(tmp_path):
    """${...} between verl keys are rewritten to ours; `recipe:` / `algorithm:` defaults and sibling files are
    followed; reward_model.enable + model.path becomes a model reward source; hydra.run.dir in the file works."""
    (tmp_path / "common.yaml").write_text("trainer:\n  project_name: shared\n  total_epochs: 2\n")
    (tmp_path / "exp.yaml").write_text(textwrap.dedent("""
        defaults:
          - ppo_trainer
          - common
          - recipe: quickstart
          - algorithm: grpo
          - _self_
        hydra:
          run:
            dir: /tmp/rlhf_runs/${trainer.experiment_name}
        actor_rollout_ref:
          actor:
            ppo_mini_batch_size: 4
            policy_loss:
              loss_mode: gspo
          rollout:
            n: 8
        critic:
          ppo_mini_batch_size: ${actor_rollout_ref.actor.ppo_mini_batch_size}
        reward_model:
          enable: true
          model:
            path: OpenRLHF/Llama-3-8b-rm
          micro_batch_size_per_gpu: 2
        trainer:
          experiment_name: exp9
          logger: tensorboard
          max_actor_ckpt_to_keep: 5
        data:
          apply_chat_template_kwargs:
            enable_thinking: false
    """))
    c = compose_config([], config_file=tmp_path / "exp.yaml")
    assert (c.algorithm.adv_estimator, c.model.path, c.rollout.n) == ("grpo", "tiny://quickstart", 8)
    assert c.actor.policy_loss.loss_mode == "gspo" and c.critic.ppo_mini_batch_size == 4
    assert (c.trainer.project_name, c.trainer.total_epochs, list(c.trainer.logger)) == ("shared", 2, ["tensorboard"])
    assert c.trainer.default_local_dir == "/tmp/rlhf_runs/exp9" and c.trainer.max_ckpt_to_keep == 5
    assert OmegaConf.to_container(c.reward.sources) == [{**OmegaConf.to_container(c.reward.sources[0]),
                                                         "type": "model", "path": "OpenRLHF/Llama-3-8b-rm",
                                                         "micro_batch_size": 2, "weight": 1.0}]
    assert dict(c.data.chat_template_kwargs) == {"enable_thinking": False}


def test_verl_context_parallel_size_maps_to_the_layout(gsm8k):
    """verl's megatron.context_parallel_size is our parallel.context_parallel_size; the reference and the
    critic must use the actor's value (refused otherwise, naming it)."""
    c = compose_config([*_lines(VERL_GSM8K_PPO, **gsm8k), "actor_rollout_ref.actor.megatron.context_parallel_size=2",
                        "actor_rollout_ref.ref.megatron.context_parallel_size=2"])
    assert c.parallel.context_parallel_size == 2
    with pytest.raises(ConfigValidationError) as ei:
        compose_config([*_lines(VERL_GSM8K_PPO, **gsm8k), "actor_rollout_ref.actor.megatron.context_parallel_size=2",
                        "actor_rollout_ref.ref.megatron.context_parallel_size=4"])
    assert "ref.megatron.context_parallel_size=4" in str(ei.value), str(ei.value)


def test_unsupported_verl_settings_are_named_all_at_once(gsm8k, capsys):
    """Every setting with no equivalent, every unknown key and every bad value: one error, each with the
    reason and what to use instead."""
    bad = ["critic.model.lora_rank=8", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
           "actor_rollout_ref.rollout.name=hf",
           "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=4", "trainer.default_hdfs_dir=hdfs://x",
           "actor_rollout_ref.actor.clip_ratoi=0.3", "trainer.totl_training_steps=3", "rollout.mode=hybrid"]
    with pytest.raises(ConfigKeyError) as ei:
        compose_config([*_lines(VERL_GSM8K_PPO, **gsm8k), *bad])
    e = ei.value
    assert len(e.problems) == len(bad), str(e)
    assert e.key == "actor_rollout_ref.actor.clip_ratoi" and "actor_rollout_ref.actor.clip_ratio" in e.suggestions
    msg = str(e)
    for s in ["lora_rank=8 is not supported", "LoRA on the critic is not supported",  # fixes in verl's keys:
              "ulysses_sequence_parallel_size=2 is not supported",
              "use actor_rollout_ref.actor.megatron.sequence_parallel",
              "rollout.name='hf' is not supported", "use actor_rollout_ref.rollout.name=sglang",
              "ref.megatron.tensor_model_parallel_size=4 is not supported",
              "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "default_hdfs_dir='hdfs://x'",
              "Did you mean: actor_rollout_ref.actor.clip_ratio", "trainer.total_training_steps",
              "rollout.mode='hybrid' is not one of [colocated, disaggregated]"]:
        assert s in msg, f"{s!r} not in\n{msg}"
    assert main(["--cfg", *_lines(VERL_GSM8K_PPO, **gsm8k), *bad]) == 2
    assert f"Invalid config ({len(bad)} problems)" in capsys.readouterr().err


def test_neutral_verl_values_are_accepted(gsm8k):
    """verl's "off" values and engine knobs compose to the same config as without them."""
    base = compose_config(_lines(VERL_QUICKSTART, **gsm8k))
    knobs = ["actor_rollout_ref.model.lora_rank=0", "actor_rollout_ref.actor.use_dynamic_bsz=False",
             "actor_rollout_ref.rollout.enforce_eager=True", "actor_rollout_ref.model.use_remove_padding=True",
             "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True", "trainer.balance_batch=True",
             "actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=True",
             "critic.model.fsdp_config.param_offload=False",
             "actor_rollout_ref.actor.optim.lr_warmup_steps=-1", "algorithm.rollout_correction.rollout_is=null"]
    assert compose_config([*_lines(VERL_QUICKSTART, **gsm8k), *knobs]) == base


def test_current_verl_keys_are_mapped_or_refused_all_at_once():
    """Keys of the current verl layout: its reward model (reward.reward_model.*) becomes a model reward source;
    features we lack are refused only when switched on, all in one error, each with the reason; an unknown
    rollout key is read as ours (rollout.*) for the suggestions."""
    c = compose_config(["reward.reward_model.enable=true", "reward.reward_model.model_path=acme/rm-7b",
                        "reward.reward_manager.name=dapo", "distillation.enabled=false", "trainer.use_v1=true",
                        "actor_rollout_ref.actor.optim.warmup_style=null",
                        "actor_rollout_ref.actor.optim.muon_momentum=0.9"])
    assert [(s.type, s.path, s.weight) for s in c.reward.sources] == [("model", "acme/rm-7b", 1.0)]
    assert c.actor.optim.lr_decay_style == compose_config([]).actor.optim.lr_decay_style
    bad = ["distillation.enabled=true", "actor_rollout_ref.rollout.disaggregation.enabled=true",
           "actor_rollout_ref.actor.qat.enable=true",
           "skip.rollout.enable=true", "actor_rollout_ref.rollout.temprature=0.7"]
    with pytest.raises(ConfigKeyError) as ei:
        compose_config(bad)
    msg = str(ei.value)
    assert len(ei.value.problems) == len(bad), msg
    for s in ["distillation.enabled=True is not supported", "on-policy distillation here: distill.enable=true",
              "disaggregation.enabled=True is not supported", "qat.enable=True is not supported",
              "skip.rollout.enable=True",
              "'actor_rollout_ref.rollout.temprature' (read as 'rollout.temprature'",
              "Did you mean: actor_rollout_ref.rollout.temperature"]:
        assert s in msg, f"{s!r} not in\n{msg}"


def test_verl_keys_without_effect_are_warned_not_silent(caplog):
    """A verl key accepted without effect is named in a warning with its reason (command line) or grouped by
    section (a config file); verl's _target_ class names are left out."""
    from rlhf.config.verl.compat import ignored_lines

    cli = "command-line override 'x'"
    assert ignored_lines([("actor_rollout_ref.rollout.enforce_eager", cli, "engine"),
                          ("trainer.balance_batch", cli, "worker"), ("a.b.free_cache_engine", cli, "engine"),
                          ("critic._target_", "config file f.yaml", "name"), ("hydra.run.dir", cli, "hydra"),
                          ("critic.profiler.tool_config.nsys.discrete", "config file f.yaml", "p"),
                          ("critic.profiler.enable", "config file f.yaml", "p"),
                          ("critic.strategy", "config file f.yaml", "s")]) == [
        "no effect here: a.b.free_cache_engine, actor_rollout_ref.rollout.enforce_eager (engine); "
        "trainer.balance_batch (worker)",
        "config file f.yaml: 3 verl settings have no effect here (engine, worker and profiler details; the reason "
        "for each is in rlhf/config/verl/keys.yaml): critic.{strategy}; critic.profiler.{enable, tool_config.*}"]
    with caplog.at_level("WARNING", logger="rlhf.config"):
        compose_config(["actor_rollout_ref.rollout.enforce_eager=True", "trainer.use_v1=true",
                        "actor_rollout_ref.rollout.name=vllm"])
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "actor_rollout_ref.rollout.enforce_eager (an SGLang engine setting chosen here)" in text
    assert "trainer.use_v1 (verl's trainer implementation switch)" in text
    assert "rollout.name=vllm: the rollout engine here is SGLang" in text
    caplog.clear()
    with caplog.at_level("WARNING", logger="rlhf.config"):
        compose_config(["actor_rollout_ref.actor.optim.lr=1e-6"])  # a mapped key: nothing to warn about
    assert not caplog.records
def test_verl_dynamic_batching_keys_map():
    """verl's dynamic-batching keys set ours (rlhf.workers.dynamic_batch)."""
    c = compose_config(["actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
                        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=8192", "critic.use_dynamic_bsz=True",
                        "critic.ppo_max_token_len_per_gpu=2048", "critic.forward_max_token_len_per_gpu=3072"])
    assert (c.actor.use_dynamic_bsz, c.actor.ppo_max_token_len_per_gpu, c.actor.log_prob_max_token_len_per_gpu) == \
        (True, 4096, 8192)
    assert (c.critic.use_dynamic_bsz, c.critic.ppo_max_token_len_per_gpu, c.critic.forward_max_token_len_per_gpu) == \
        (True, 2048, 3072)


def test_verl_mini_batch_shuffle_keys_map(caplog):
    """verl's actor/critic ``shuffle`` (the Megatron workers' mini-batch permutation) sets ours; before, both were
    accepted without effect.  ``data_loader_seed`` has none (the step seeds the permutation) and says so."""
    assert (compose_config([]).actor.shuffle, compose_config([]).critic.shuffle) == (False, False)  # verl's defaults
    with caplog.at_level("WARNING", logger="rlhf.config"):
        c = compose_config(["actor_rollout_ref.actor.shuffle=True", "critic.shuffle=True",
                            "actor_rollout_ref.actor.data_loader_seed=7"])
    assert (c.actor.shuffle, c.critic.shuffle) == (True, True)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "actor_rollout_ref.actor.data_loader_seed (the mini-batch permutation" in text and "shuffle" not in \
        text.replace("actor.shuffle / critic.shuffle", "")


def test_verl_algorithm_keys_and_override_prefixes():
    """The algorithm zoo's config side through verl's names; verl's `+key` for a key we have; dict-valued fields."""
    c = compose_config(["actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "algorithm.adv_estimator=remax",
                        "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.001", "actor_rollout_ref.actor.tau_neg=1.2",
                        "+actor_rollout_ref.actor.clip_ratio=0.3", "data.chat_template_kwargs.enable_thinking=false"])
    assert (c.actor.policy_loss.loss_mode, c.algorithm.adv_estimator, c.rollout.n) == ("gspo", "remax", 1)
    assert (c.actor.policy_loss.clip_cov_ratio, c.actor.tau_neg, c.actor.clip_ratio) == (0.001, 1.2, 0.3)
    assert dict(c.data.chat_template_kwargs) == {"enable_thinking": False}
    validate_config(c, world_size=1)
    with pytest.raises(ConfigValidationError, match="algorithm.adv_estimator=grpo_passk .* needs rollout.n >= 2"):
        validate_config(compose_config(["algorithm.adv_estimator=grpo_passk", "actor_rollout_ref.rollout.n=1"]))


def _verl_file(mirror: Path, name: str) -> str:
    """verl's flattened config ``name`` from a fetched copy of verl (read at test time, never copied here)."""
    if not mirror.exists():
        pytest.skip(f"no fetched copy of verl at {mirror}")
    r = subprocess.run(["git", "--git-dir", str(mirror / ".git") if (mirror / ".git").exists() else str(mirror),
                        "show", f"HEAD:verl/trainer/config/{name}"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"{name} is not in the fetched copy {mirror}")
    return r.stdout


@pytest.mark.parametrize("mirror", [VERL_MIRROR, VERL_MIRROR.parents[1] / "verl-project+verl" / "repo"],
                         ids=["volcengine", "verl-project"])
@pytest.mark.parametrize("name", ["_generated_ppo_megatron_trainer.yaml", "_generated_ppo_trainer.yaml"])
def test_verl_generated_config_files(mirror, name, tmp_path, gsm8k, capsys, caplog):
    """verl's full flattened configs (ppo_trainer.yaml = FSDP and ppo_megatron_trainer.yaml, of the older and
    the current verl) pass with only their placeholder paths replaced; the hundreds of worker / engine keys
    that have no effect here are named in one warning per file, none silently."""
    (tmp_path / "gen.yaml").write_text(_verl_file(mirror, name))
    f = gsm8k["files"]
    args = ["--config", str(tmp_path / "gen.yaml"), "--cfg", f"data.train_files={f['gsm8k_train']}",
            f"data.val_files={f['gsm8k_test']}", "actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct",
            "critic.model.path=Qwen/Qwen2-7B-Instruct", "actor_rollout_ref.rollout.name=sglang"]
    with caplog.at_level("WARNING", logger="rlhf.config"):
        assert main(args) == 0, capsys.readouterr().err
    c = OmegaConf.create(yaml.safe_load(capsys.readouterr().out))
    assert c.trainer.default_local_dir == "checkpoints/verl_examples/gsm8k" and c.actor.optim.weight_decay == 0.01
    assert c.critic.ppo_mini_batch_size == c.actor.ppo_mini_batch_size == 256 and c.data.train_batch_size == 1024
    assert (c.actor.optim.lr, c.critic.optim.lr, c.actor.clip_ratio, c.algorithm.adv_estimator) == (1e-6, 1e-5, 0.2,
                                                                                                      "gae")
    assert list(c.trainer.logger) == ["console", "wandb"] and c.reward.sources == []  # verl's RM is off
    if "megatron" in name:
        assert c.model.dtype == "bfloat16"
    warned = [r.getMessage() for r in caplog.records if "verl settings have no effect here" in r.getMessage()]
    assert len(warned) == 1, warned
    n = int(re.search(r"(\d+) verl settings have no effect", warned[0]).group(1))
    assert n > 300 and "_target_" not in warned[0] and len(warned[0]) < 8000, warned[0]
    for part in ("actor_rollout_ref.rollout.{", "enforce_eager", "free_cache_engine", "profiler.*", "critic.model.{"):
        assert part in warned[0], part


def test_a_verl_config_tree_is_composed_by_hydra_first(tmp_path):
    """--config-path DIR --config-name ppo_trainer on a verl-style tree (group defaults with packages, nested
    defaults, `override`, _self_) reads what Hydra composes there; the command line still wins."""
    conf = tmp_path / "config"
    (conf / "actor").mkdir(parents=True)
    (conf / "engine").mkdir()
    (conf / "actor" / "actor.yaml").write_text("ppo_mini_batch_size: 8\nclip_ratio: 0.3\noptim:\n  lr: 1e-6\n")
    (conf / "actor" / "dp_actor.yaml").write_text("defaults:\n  - actor\n  - _self_\nstrategy: fsdp\n"
                                                  "optim:\n  lr: 2e-6\n")
    (conf / "engine" / "fsdp.yaml").write_text("save_freq: 3\n")
    (conf / "engine" / "megatron.yaml").write_text("save_freq: 9\n")
    (conf / "shared.yaml").write_text("total_epochs: 7\n")
    (conf / "ppo_trainer.yaml").write_text(textwrap.dedent("""
        defaults:
          - actor@actor_rollout_ref.actor: dp_actor
          - engine@trainer: fsdp
          - shared@trainer
          - override engine@trainer: megatron
          - _self_
        actor_rollout_ref:
          actor:
            clip_ratio: 0.25
        trainer:
          experiment_name: tree
    """))
    path = find_config_file(str(conf), "ppo_trainer")
    assert path == conf / "ppo_trainer.yaml"
    c = compose_config([], config_file=path)
    assert (c.actor.ppo_mini_batch_size, c.actor.optim.lr, c.actor.clip_ratio) == (8, 2e-6, 0.25)
    assert (c.trainer.total_epochs, c.trainer.save_freq, c.trainer.experiment_name) == (7, 9, "tree")
    c = compose_config(["actor_rollout_ref.actor.ppo_mini_batch_size=4"], config_file=path)
    assert c.actor.ppo_mini_batch_size == 4
    assert compose_config([]) == compose_config([])  # our own Hydra state is untouched


@pytest.mark.parametrize("mirror,name", [(VERL_MIRROR.parents[1] / "verl-project+verl" / "repo", "ppo_trainer"),
                                         (VERL_MIRROR, "ppo_megatron_trainer")], ids=["current-fsdp", "older-megatron"])
def test_verl_own_config_tree_equals_its_generated_file(mirror, name, tmp_path, gsm8k):
    """verl's config directory (verl/trainer/config of a fetched copy, extracted at test time) read with
    --config-path/--config-name gives the same config as verl's flattened _generated_<name>.yaml."""
    if not mirror.exists():
        pytest.skip(f"no fetched copy of verl at {mirror}")
    git_dir = str(mirror / ".git") if (mirror / ".git").exists() else str(mirror)
    archive = subprocess.run(["git", "--git-dir", git_dir, "archive", "HEAD", "verl/trainer/config"],
                             capture_output=True)
    if archive.returncode != 0:
        pytest.skip("verl/trainer/config is not in the fetched copy")
    subprocess.run(["tar", "x", "-C", str(tmp_path)], input=archive.stdout, check=True)
    tree = tmp_path / "verl" / "trainer" / "config"
    f = gsm8k["files"]
    args = [f"data.train_files={f['gsm8k_train']}", f"data.val_files={f['gsm8k_test']}",
            "actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct", "critic.model.path=Qwen/Qwen2-7B-Instruct",
            "actor_rollout_ref.rollout.name=sglang"]
    composed = compose_config(args, config_file=find_config_file(str(tree), name))
    assert composed == compose_config(args, config_file=tree / f"_generated_{name}.yaml")
    assert composed.data.train_batch_size == 1024 and composed.actor.optim.lr == 1e-6


# --------------------------------------------------------------------------- Hydra's standard options


def test_hydra_options(tmp_path, capsys):
    """Hydra's own parser reads the command line (``--cfg job|hydra|all``, ``-c``, ``--resolve``, ``-m``); rlhf's
    config-file options are checked first.  ``-m`` and ``--cfg hydra`` were refused before Hydra ran the app; they are
    Hydra's now (multirun: test_hydra_multirun)."""
    assert parse_args(["--cfg", "job", "a.b=1"])[0]["cfg"] and parse_args(["-c", "job"])[0]["cfg"]
    assert parse_args(["--cfg=all", "--resolve"])[0]["cfg"]
    assert parse_args(["-m", "trainer.seed=1,2"])[0]["hydra"] == ["-m"]
    for argv, msg in [(["--config-name", "nope"], "no such config file"),
                      (["--config-path", str(tmp_path)], "needs --config-name"), (["--config"], "needs a value")]:
        with pytest.raises(UsageError, match=msg):
            parse_args(argv)
    assert main(["--cfg", "hydra", "recipe=quickstart"]) == 0  # Hydra's own config: the run directory, ...
    assert yaml.safe_load(capsys.readouterr().out)["hydra"]["run"]["dir"] == "${trainer.default_local_dir}"
    # verl's base names without a file of theirs: verl's defaults for the name (tests/unit/config/
    # test_verl_config_names.py)
    from rlhf.config.config_file import VERL_DEFAULTS

    assert parse_args(["--config-path=./config", "--config-name=ppo_trainer"])[0]["config_file"] == \
        VERL_DEFAULTS / "ppo_trainer.yaml"


@pytest.fixture
def fake_trainer(monkeypatch, tmp_path):
    """rlhf.trainer replaced by a stand-in that records the configs it is run with (cwd: tmp_path)."""
    import types

    import rlhf

    monkeypatch.chdir(tmp_path)
    runs = []
    fake = types.ModuleType("rlhf.trainer")
    fake.run = lambda cfg: runs.append(cfg) or {}
    monkeypatch.setitem(sys.modules, "rlhf.trainer", fake)
    monkeypatch.setattr(rlhf, "trainer", fake, raising=False)
    return runs


def test_hydra_run_dir(tmp_path, fake_trainer):
    """hydra.run.dir=DIR is the run directory: trainer.default_local_dir unless that is given, and Hydra writes
    DIR/.hydra/ (the composed config, the overrides); without it the run directory is trainer.default_local_dir.
    (Before, rlhf.main wrote .hydra/ itself, only with hydra.run.dir.)"""
    run = tmp_path / "runs" / "x"
    c = compose_config([f"hydra.run.dir={run}"], recipe="quickstart")
    assert c.trainer.default_local_dir == str(run)
    c2 = compose_config([f"hydra.run.dir={run}", "trainer.default_local_dir=/elsewhere"], recipe="quickstart")
    assert c2.trainer.default_local_dir == "/elsewhere"
    argv = ["recipe=quickstart", f"hydra.run.dir={tmp_path}/runs/${{trainer.experiment_name}}"]
    c3 = compose_config(argv)
    out = tmp_path / "runs" / c3.trainer.experiment_name
    assert c3.trainer.default_local_dir == str(out) != str(run)
    assert main([*argv, "trainer.total_training_steps=2"]) == 0
    assert [cfg.trainer.default_local_dir for cfg in fake_trainer] == [str(out)]
    written = OmegaConf.load(out / ".hydra/config.yaml")
    assert written.trainer.total_training_steps == 2 and written.model.path == "tiny://quickstart"
    assert yaml.safe_load((out / ".hydra/overrides.yaml").read_text()) == [
        "recipe=quickstart", "trainer.total_training_steps=2", f"trainer.default_local_dir={argv[1].split('=')[1]}"]
    assert main(["recipe=quickstart", "trainer.total_training_steps=2"]) == 0
    assert (tmp_path / "outputs" / "quickstart" / ".hydra" / "config.yaml").is_file()


def test_hydra_multirun(tmp_path, monkeypatch, capsys):
    """-m runs one job per setting of the sweep (verl's keys too), one after another, each as a process of its own
    in <trainer.default_local_dir>/<job number> (Hydra writes its .hydra/ there); every job's config is checked
    before the first starts; a failed job stops the sweep with its exit code.  (Before: refused, exit 2.)"""
    import subprocess

    jobs = []
    monkeypatch.setattr(subprocess, "call", lambda cmd, **kw: jobs.append(cmd) or (3 if len(jobs) == 3 else 0))
    sweep = tmp_path / "sweep"
    base = ["recipe=quickstart", f"trainer.default_local_dir={sweep}", "trainer.total_training_steps=1"]
    assert main(["-m", *base, "trainer.seed=1,2", "actor_rollout_ref.actor.optim.lr=1e-4,2e-4"]) == 3
    assert [cmd[:3] for cmd in jobs] == [[sys.executable, "-m", "rlhf.main"]] * 3
    got = [compose_config(cmd[3:]) for cmd in jobs]
    assert [(c.trainer.seed, c.actor.optim.lr, c.trainer.default_local_dir) for c in got] == [
        (1, 1e-4, str(sweep / "0")), (1, 2e-4, str(sweep / "1")), (2, 1e-4, str(sweep / "2"))]
    assert all((sweep / str(i) / ".hydra" / "config.yaml").is_file() for i in range(3))
    jobs.clear()
    assert main(["-m", *base, "rollout.top_p=0.5,0"]) == 2  # the second job's value is bad: no job starts
    assert "rollout.top_p=0.0 must be in (0, 1]" in capsys.readouterr().err and jobs == []


# --------------------------------------------------------------------------- checks that need files


def test_data_and_model_references_are_classified():
    assert parse_data_ref("openai/gsm8k:main@test") == parse_data_ref("openai/gsm8k:main@test")
    r = parse_data_ref("openai/gsm8k:main@train[:100]")
    assert (r.kind, r.path, r.config, r.split) == ("hub", "openai/gsm8k", "main", "train[:100]")
    assert parse_data_ref("openai/gsm8k").kind == "hub" and parse_data_ref("embedded://arithmetic").kind == "embedded"
    for local in ("/no/such/train.parquet", "./x.jsonl", "data.parquet", "~/nope/dir/"):
        r = parse_data_ref(local)
        assert r.kind == "local" and not r.exists, local
    assert parse_data_ref("gsm8k").kind == "invalid" and parse_data_ref("s3://b/k").kind == "invalid"
    assert parse_model_ref("Qwen/Qwen2-7B").kind == "hub" and parse_model_ref("tiny://quickstart").exists
    assert not parse_model_ref("tiny://other").exists and parse_model_ref("/no/model").kind == "local"


def _model_dir(root: Path, arch: str = "Qwen2ForCausalLM", **extra) -> Path:
    """A model directory with a real (small) config.json of ``arch``."""
    from transformers import AutoConfig

    model_type = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama", "GPT2LMHeadModel": "gpt2",
                  "BertForMaskedLM": "bert"}[arch]
    cfg = AutoConfig.for_model(model_type, num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=128, vocab_size=256).to_dict()
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({**cfg, "architectures": [arch], "max_position_embeddings": 4096,
                                                  **extra}))
    return root


def test_file_checks_run_before_any_download(tmp_path, capsys, monkeypatch):
    """Missing local data, a model directory without config.json, an unsupported architecture (local or in the
    HF cache) are all reported by --cfg; hub names that are not cached pass (no download) while the hub is
    reachable (offline: tests/unit/config/test_preflight.py)."""
    from rlhf import preflight

    monkeypatch.setattr(preflight, "hub_unreachable", lambda: None)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "data_source": "x"}\n')
    good = _model_dir(tmp_path / "qwen")
    bert = _model_dir(tmp_path / "bert", "BertForMaskedLM")
    yarn = _model_dir(tmp_path / "yarn", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    (tmp_path / "empty").mkdir()
    ok = [f"data.train_files={data}", "data.val_files=openai/gsm8k:main@test", f"model.path={good}"]
    validate_config(compose_config(ok), world_size=1, check_files=True)
    assert main(["--cfg", *ok]) == 0
    capsys.readouterr()
    bad = [f"data.train_files=[{data},{tmp_path}/missing.parquet]", "data.val_files=gsm8k", f"model.path={bert}",
           f"model.critic_path={tmp_path / 'empty'}", "critic.enable=true", f"model.tokenizer_path={tmp_path}/tok",
           "reward.sources=[{type:model,path:/no/rm}]"]
    with pytest.raises(ConfigValidationError) as ei:
        validate_config(compose_config(bad), world_size=1, check_files=True)
    msg = str(ei.value)
    assert len(ei.value.problems) == 6, msg
    for s in ["data.train_files[1]=", "missing.parquet': no such file or directory", "data.val_files='gsm8k': not a "
              "local file", "unsupported architecture ['BertForMaskedLM']", "has no config.json",
              "model.tokenizer_path=", "reward.sources[0].path='/no/rm'"]:
        assert s in msg, f"{s!r} not in\n{msg}"
    validate_config(compose_config(bad), world_size=1)  # without check_files: no file is looked at
    assert main(["--cfg", *bad]) == 2
    with pytest.raises(ConfigValidationError, match="rope_type='yarn' is not supported"):
        validate_config(compose_config([f"model.path={yarn}"]), check_files=True)


def test_hub_model_checked_only_from_the_local_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants as hc

    snap = tmp_path / "models--acme--bert-7b" / "snapshots" / "abc123"
    _model_dir(snap, "BertForMaskedLM")
    (tmp_path / "models--acme--bert-7b" / "refs").mkdir()
    (tmp_path / "models--acme--bert-7b" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ConfigValidationError, match=r"model.path='acme/bert-7b': unsupported architecture \['BertForMaskedLM'\]"):
        validate_config(compose_config(["model.path=acme/bert-7b"]), check_files=True)
    validate_config(compose_config(["model.path=acme/not-downloaded"]), check_files=True)  # no network: passes


def test_check_model_config_hook(tmp_path):
    from rlhf.preflight import check_model_config

    assert check_model_config(_model_dir(tmp_path / "a")) == []
    assert check_model_config(_model_dir(tmp_path / "b", "LlamaForCausalLM") / "config.json") == []
    assert "unsupported architecture" in check_model_config(_model_dir(tmp_path / "c", "GPT2LMHeadModel"))[0]
    # the parallel layout is checked from config.json too (2 layers do not split over 4 pipeline stages)
    assert "pipeline" in check_model_config(_model_dir(tmp_path / "d"), dict(pp=4))[0]
    assert check_model_config(tmp_path / "missing") == []  # unreadable: reported by the caller's own rules


def test_verl_offload_and_megatron_optimizer_keys_are_mapped():
    """verl's megatron offload switches of actor, reference and critic, and megatron-core's optimizer options
    (optim.*, optim.override_optimizer_config.*) land on our keys; megatron's own constraints are config problems
    naming the key (a low-precision moment without the precision-aware optimizer, a CPU offload of nothing)."""
    from rlhf.config.validate import config_problems

    on = ["actor_rollout_ref.actor.megatron.param_offload=true", "actor_rollout_ref.actor.megatron.grad_offload=true",
          "actor_rollout_ref.actor.megatron.optimizer_offload=true", "actor_rollout_ref.ref.megatron.param_offload=true",
          "actor_rollout_ref.ref.megatron.grad_offload=true", "critic.megatron.param_offload=true",
          "critic.megatron.optimizer_offload=true",
          "+actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload=true",
          "+actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_offload_fraction=0.5",
          "actor_rollout_ref.actor.optim.use_precision_aware_optimizer=true",
          "actor_rollout_ref.actor.optim.exp_avg_dtype=bf16",
          "+actor_rollout_ref.actor.optim.override_optimizer_config.exp_avg_sq_dtype=torch.bfloat16",
          "actor_rollout_ref.actor.optim.main_grads_dtype=null"]
    c = compose_config(on)
    assert dict(c.actor.offload) == {"params": True, "grads": True, "optimizer": True} and c.actor.ref_param_offload
    assert dict(c.critic.offload) == {"params": True, "grads": False, "optimizer": True}
    o = c.actor.optim
    assert (o.optimizer_cpu_offload, o.optimizer_offload_fraction, o.use_precision_aware_optimizer) == (True, 0.5, True)
    assert (o.exp_avg_dtype, o.exp_avg_sq_dtype, o.main_grads_dtype, o.main_params_dtype) == ("bf16", "bf16", "fp32",
                                                                                               "fp32")
    assert not config_problems(c)
    off = compose_config([k.replace("=true", "=false") for k in on[:7]])
    assert off.actor.offload == compose_config([]).actor.offload and not off.actor.ref_param_offload
    bad = compose_config(["critic.optim.exp_avg_dtype=bf16", "actor.optim.optimizer_cpu_offload=true",
                          "actor.optim.exp_avg_sq_dtype=int4"])
    msg = "\n".join(config_problems(bad))
    for s in ["critic.optim.exp_avg_dtype='bf16' needs critic.optim.use_precision_aware_optimizer=true",
              "actor.optim.optimizer_cpu_offload=true with actor.optim.optimizer_offload_fraction=0 offloads nothing",
              "actor.optim.exp_avg_sq_dtype='int4' must be one of ['fp32', 'fp16', 'bf16', 'fp8']"]:
        assert s in msg, f"{s!r} not in\n{msg}"


def test_verl_gpu_job_gets_one_engine_per_rollout_tp_group(caplog):
    """verl's hybrid engine runs one rollout replica per rollout TP group of the job's GPUs: 8 GPUs at rollout TP 2
    are 4 engines (before: our schema's default of 1 engine on 2 of the 8 GPUs), on every node (before: rank 0's
    node only, 2 of verl's 4 at 2 nodes x 8, with a warning); with expert parallelism too (before: the most that
    placed on rank 0's node, 2, with a warning: the engines mapped the stage leaders' memory); where verl's count does
    not place (an engine of TP 3 would span nodes) the most that place, with a warning."""
    assert compose_config(["trainer.n_gpus_per_node=8", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]
                          ).rollout.num_engines == 4
    verl = ["trainer.nnodes=2", "trainer.n_gpus_per_node=8", "actor_rollout_ref.rollout.tensor_model_parallel_size=4"]
    with caplog.at_level(logging.WARNING, logger="rlhf.config"):
        assert compose_config(verl).rollout.num_engines == 4
        guide = ["trainer.nnodes=4", "trainer.n_gpus_per_node=8", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]
        assert compose_config(guide).rollout.num_engines == 16  # the production guide's deployment (was 4)
        assert "this job places" not in caplog.text
        assert compose_config([*verl, "parallel.expert_model_parallel_size=2"]).rollout.num_engines == 4
        assert "this job places" not in caplog.text
        odd = ["trainer.nnodes=2", "trainer.n_gpus_per_node=8", "actor_rollout_ref.rollout.tensor_model_parallel_size=3"]
        assert compose_config(odd).rollout.num_engines == 2
    assert "verl would run 5 rollout replicas here; this job places 2" in caplog.text
    # the user's own count wins, in either layout; our layout alone keeps our default; a CPU job keeps one engine
    assert compose_config([*verl, "rollout.num_engines=1"]).rollout.num_engines == 1
    assert compose_config(["trainer.n_gpus_per_node=8", "rollout.tensor_model_parallel_size=2"]
                          ).rollout.num_engines == 1
    assert compose_config(["actor_rollout_ref.rollout.tensor_model_parallel_size=1"]).rollout.num_engines == 1

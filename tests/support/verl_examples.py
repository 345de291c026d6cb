"""verl's Megatron example commands (fixtures/verl_megatron_examples.json) run through ``python -m rlhf.main --cfg``
in-process, and a small verl-style config directory built from the key set of verl's ``verl/trainer/config``
(its group layout and the defaults that matter here), so CI covers verl's own config directory without a copy
of verl."""
from __future__ import annotations

import contextlib
import io
import json
import textwrap
from pathlib import Path

from tests.support.paths import REPO

FIXTURE = REPO / "tests" / "support" / "fixtures" / "verl_megatron_examples.json"


def examples() -> dict:
    """``{script: {"options": [--config-path=..., --config-name=...], "overrides": [key=value, ...]}}``."""
    return json.loads(FIXTURE.read_text())["examples"]


def example_args(name: str, paths: dict, config_dir: Path | None = None) -> list[str]:
    """The ``--cfg`` command line of example ``name``: its overrides with ``paths`` (train, test, model, ckpt)
    filled in, after ``--config-path config_dir --config-name <its name>`` when ``config_dir`` is given."""
    ex = examples()[name]
    opts = []
    if config_dir is not None:
        opts = ["--config-path", str(config_dir), "--config-name", ex["options"][1].split("=", 1)[1]]
    return ["--cfg", *opts, *(o.format(**paths) for o in ex["overrides"])]


def run_cfg(argv: list[str]) -> tuple[int, str, str]:
    """``rlhf.main.main(["--cfg", *argv])`` in this process (compose and check only): (exit code, stdout,
    stderr)."""
    from rlhf.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv if "--cfg" in argv else ["--cfg", *argv])
    return code, out.getvalue(), err.getvalue()


def problems(stderr: str) -> list[str]:
    """The problem lines of a config error (``  - ...``)."""
    return [line[4:] for line in stderr.splitlines() if line.startswith("  - ")]


_ENGINE = """\
    param_offload: false
    grad_offload: false
    optimizer_offload: false
    tensor_model_parallel_size: 1
    expert_model_parallel_size: 1
    expert_tensor_parallel_size: null
    pipeline_model_parallel_size: 1
    virtual_pipeline_model_parallel_size: null
    context_parallel_size: 1
    sequence_parallel: true
    use_distributed_optimizer: true
    use_dist_checkpointing: false
    seed: 42
    override_ddp_config: {}
    override_transformer_config:
      recompute_granularity: null
      recompute_modules: [core_attn]
      recompute_method: null
      recompute_num_layers: null
      attention_backend: flash
    override_mcore_model_config: {}
    use_mbridge: false
    dtype: bfloat16
"""
_MAIN = """\
    defaults:
      - engine@actor_rollout_ref.actor.megatron: megatron
      - engine@actor_rollout_ref.ref.megatron: megatron
      - engine@critic.megatron: megatron
      - _self_
    actor_rollout_ref:
      model:
        path: ~/models/deepseek-llm-7b-chat
        enable_gradient_checkpointing: true
      actor:
        strategy: megatron
        ppo_mini_batch_size: 256
        optim:
          lr: 1e-6
      ref:
        megatron:
          tensor_model_parallel_size: ${oc.select:actor_rollout_ref.actor.megatron.tensor_model_parallel_size,1}
          override_transformer_config: ${oc.select:actor_rollout_ref.actor.megatron.override_transformer_config,{}}
      rollout:
        name: vllm
        multi_turn:
          enable: false
    critic:
      strategy: megatron
      model:
        path: ~/models/deepseek-llm-7b-chat
        enable_gradient_checkpointing: true
      ppo_mini_batch_size: ${actor_rollout_ref.actor.ppo_mini_batch_size}
      optim:
        lr: 1e-5
    data:
      train_batch_size: 1024
    trainer:
      logger: [console, wandb]
"""


def write_verl_config_dir(root: Path) -> Path:
    """A verl-style ``verl/trainer/config`` under ``root`` (``ppo_megatron_trainer.yaml`` composing
    ``engine/megatron.yaml`` into the actor, the reference and the critic, as verl's does); returns it."""
    conf = root / "verl" / "trainer" / "config"
    (conf / "engine").mkdir(parents=True, exist_ok=True)
    (conf / "engine" / "megatron.yaml").write_text(textwrap.dedent(_ENGINE))
    (conf / "ppo_megatron_trainer.yaml").write_text(textwrap.dedent(_MAIN))
    return conf

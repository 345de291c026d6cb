"""verl's config names (``--config-path=config --config-name=ppo_megatron_trainer`` / ``ppo_trainer``, as all of
verl's example scripts say) carry verl's defaults wherever they run, and the run says which config folder it loaded.
CPU, in-process (``rlhf.main --cfg``)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from rlhf.config import compose_config
from tests.support.verl_examples import run_cfg

VERL_MIRROR = Path("/work/.mirror/volcengine+verl/repo")
#: composed keys where rlhf/config/verl/<name>.yaml leaves ours on purpose (the file's header says why): verl's
#: placeholder model and data paths, its 8-GPU node (and the replica count that follows), its checkpoint directory
#: (here also Hydra's run directory), its wandb logger; and the
#: log-prob / critic-forward token budgets, which verl's _generated file shows resolved from its
#: ${...ppo_max_token_len_per_gpu} interpolation (16384 / 32768) and ours leaves null, meaning the same key
NOT_CARRIED = {"model.critic_path", "data.val_files", "trainer.n_gpus_per_node", "trainer.nnodes",
               "rollout.num_engines", "trainer.logger", "trainer.default_local_dir",
               "actor.log_prob_max_token_len_per_gpu",
               "critic.forward_max_token_len_per_gpu"}


@pytest.fixture
def data(tmp_path):
    row = {"prompt": "What is 2 + 3?", "data_source": "openai/gsm8k", "answer": "#### 5"}
    (tmp_path / "train.jsonl").write_text(json.dumps(row) + "\n")
    return str(tmp_path / "train.jsonl")


def _cfg(argv: list[str]) -> tuple[dict, str]:
    code, out, err = run_cfg(argv)
    assert code == 0, err
    return yaml.safe_load(out), err


@pytest.mark.parametrize("name", ["ppo_megatron_trainer.yaml", "ppo_megatron_trainer"])
def test_verl_megatron_config_name_from_an_empty_folder_gets_verls_defaults(name, data, tmp_path, monkeypatch):
    """verl's example form run from an empty folder: bf16, sequence parallel on, weight decay 0.01 (actor and
    critic), the distributed optimizer on (actor and critic), rollout in bf16 at TP 2, verl's batch sizes; one line
    names the folder it loaded (here: none found, verl's defaults).  Without a config name: ours (fp32, SP off)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    common = ["--cfg", "job", f"data.train_files={data}", "actor_rollout_ref.model.path=tiny://quickstart"]
    cfg, err = _cfg(["--config-path=config", f"--config-name={name}", *common])
    assert cfg["model"]["dtype"] == "bfloat16"
    assert cfg["parallel"]["sequence_parallel"] is True
    assert cfg["actor"]["optim"]["weight_decay"] == 0.01 and cfg["critic"]["optim"]["weight_decay"] == 0.01
    assert cfg["actor"]["optim"]["use_distributed_optimizer"] is True
    assert cfg["critic"]["optim"]["use_distributed_optimizer"] is True
    assert (cfg["rollout"]["dtype"], cfg["rollout"]["tensor_model_parallel_size"]) == ("bfloat16", 2)
    assert (cfg["data"]["train_batch_size"], cfg["actor"]["ppo_mini_batch_size"]) == (1024, 256)
    [line] = [ln for ln in err.splitlines() if "config:" in ln]
    assert "no config/ppo_megatron_trainer.yaml in" in line and "rlhf/config/verl/ppo_megatron_trainer.yaml" in line
    ours, err = _cfg(common)
    assert (ours["model"]["dtype"], ours["parallel"]["sequence_parallel"]) == ("float32", False)
    assert ours["actor"]["optim"]["weight_decay"] == 0.0 and "config:" not in err


def test_command_line_wins_over_verls_defaults(data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg, _ = _cfg(["--config-path=config", "--config-name=ppo_megatron_trainer", f"data.train_files={data}",
                   "actor_rollout_ref.model.path=tiny://quickstart", "actor_rollout_ref.actor.megatron.dtype=float32",
                   "actor_rollout_ref.actor.optim.weight_decay=0.1", "data.train_batch_size=8",
                   "actor_rollout_ref.actor.ppo_mini_batch_size=4"])
    assert (cfg["model"]["dtype"], cfg["actor"]["optim"]["weight_decay"]) == ("float32", 0.1)
    assert cfg["parallel"]["sequence_parallel"] is True


def test_a_config_folder_of_the_users_is_loaded_and_named(data, tmp_path, monkeypatch):
    """A config/ppo_megatron_trainer.yaml in the working directory is the user's: loaded, and the line names it."""
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "ppo_megatron_trainer.yaml").write_text("data:\n  max_prompt_length: 77\n")
    monkeypatch.chdir(tmp_path)
    cfg, err = _cfg(["--config-path=config", "--config-name=ppo_megatron_trainer", f"data.train_files={data}",
                     "actor_rollout_ref.model.path=tiny://quickstart"])
    assert cfg["data"]["max_prompt_length"] == 77 and cfg["model"]["dtype"] == "float32"  # the user's file only
    [line] = [ln for ln in err.splitlines() if "config:" in ln]
    assert f"folder {(tmp_path / 'config').resolve()}, file ppo_megatron_trainer.yaml" in line


def _flat(d: dict, p: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{p}{k}.") if isinstance(v, dict) and v else {f"{p}{k}": v})
    return out


@pytest.mark.parametrize("name", ["ppo_megatron_trainer", "ppo_trainer"])
def test_verl_defaults_compose_as_verls_own_generated_config(name, data, tmp_path):
    """Composed with rlhf/config/verl/<name>.yaml, the config equals the one composed with verl's own
    verl/trainer/config/_generated_<name>.yaml (every key; NOT_CARRIED left out); skips without a fetched verl."""
    from omegaconf import OmegaConf

    from rlhf.config.config_file import VERL_DEFAULTS

    if not VERL_MIRROR.exists():
        pytest.skip(f"no fetched copy of verl at {VERL_MIRROR}")
    archive = subprocess.run(["git", "--git-dir", str(VERL_MIRROR), "archive", "HEAD",
                              f"verl/trainer/config/_generated_{name}.yaml"], capture_output=True)
    if archive.returncode:
        pytest.skip("verl/trainer/config is not in the fetched copy")
    subprocess.run(["tar", "x", "-C", str(tmp_path)], input=archive.stdout, check=True)
    base = [f"data.train_files={data}", "actor_rollout_ref.model.path=tiny://quickstart"]
    ours = _flat(OmegaConf.to_container(compose_config(base, config_file=VERL_DEFAULTS / f"{name}.yaml")))
    verls = _flat(OmegaConf.to_container(compose_config(
        base, config_file=tmp_path / "verl" / "trainer" / "config" / f"_generated_{name}.yaml")))
    differ = {k: (ours.get(k), verls.get(k)) for k in set(ours) | set(verls) if ours.get(k) != verls.get(k)}
    if name == "ppo_trainer":  # verl's FSDP trainer computes in bf16 (fsdp_config.dtype): model.dtype here
        assert differ.pop("model.dtype") == ("bfloat16", "float32")
    assert set(differ) <= NOT_CARRIED, {k: v for k, v in differ.items() if k not in NOT_CARRIED}

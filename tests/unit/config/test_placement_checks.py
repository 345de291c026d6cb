"""The placement check of ``python -m rlhf.main ... --cfg``, ``--plan-memory`` and the start of a run: engines
and trainer ranks that do not fit the job's GPUs are refused by name before any model is built.

* disaggregated: the engines (rollout.num_engines x rollout.tensor_model_parallel_size) take GPUs beside the
  trainer's, out of trainer.nnodes x trainer.n_gpus_per_node (or this machine's GPUs at the start of a run);
* colocated: the engines map CUDA IPC handles of trainer rank 0's memory, so they must all be on its node.

The 7B PPO recipe: TP4 trainer, 4 engines of TP2.  The model is a config.json-only directory shaped like
Qwen2-7B (no weights, no download)."""
import json
import sys
import types

import pytest

from rlhf.config import compose_config
from rlhf.memory_plan.cli import plan_memory_report
from tests.unit.memory_plan.test_memory_plan import QWEN2_7B

RECIPE = "recipe=gsm8k_ppo_qwen2_7b"
DISAGG = "rollout.mode=disaggregated"


@pytest.fixture()
def builds(monkeypatch, tmp_path):
    """rlhf.trainer replaced by a recorder: a run that gets past the checks calls its run(cfg) (where the
    three models would be built) and is recorded instead; no torchrun/Slurm variables from outside."""
    import rlhf

    calls = []
    fake = types.ModuleType("rlhf.trainer")
    fake.run = lambda cfg: calls.append(cfg)
    monkeypatch.setitem(sys.modules, "rlhf.trainer", fake)
    monkeypatch.setattr(rlhf, "trainer", fake, raising=False)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.chdir(tmp_path)
    return calls


@pytest.fixture()
def files(tmp_path):
    """model.path (config.json of Qwen2-7B alone) and data files for the --cfg file checks."""
    model = tmp_path / "qwen2_7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN2_7B))
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
    return [f"model.path={model}", f"data.train_files={data}", f"data.val_files={data}",
            f"trainer.default_local_dir={tmp_path / 'out'}"]


def _main(argv):
    from rlhf.main import main

    return main(argv)


# --------------------------------------------------------------------------- --cfg


def test_cfg_refuses_disaggregated_7b_with_no_gpu_left_for_the_trainer(builds, files, capsys):
    code = _main([RECIPE, DISAGG, "trainer.n_gpus_per_node=8", *files, "--cfg"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert ("rollout.mode=disaggregated with rollout.num_engines=4 x rollout.tensor_model_parallel_size=2 on 8 GPUs "
            "(nodes x trainer.n_gpus_per_node = 1 x 8): the engines take 8 GPUs and leave none for the trainer") in err
    assert "lower rollout.num_engines" in err and "rollout.mode=colocated" in err
    assert builds == []


def test_cfg_accepts_disaggregated_7b_with_gpus_left(builds, files, capsys):
    # 2 engines of TP2 keep GPUs 4-7, the TP4 trainer gets GPUs 0-3 (DP1)
    code = _main([RECIPE, DISAGG, "rollout.num_engines=2", "trainer.n_gpus_per_node=8", *files, "--cfg"])
    assert code == 0, capsys.readouterr().err
    assert builds == []


def test_cfg_refuses_a_launched_trainer_that_leaves_the_engines_too_few_gpus(builds, files, capsys, monkeypatch):
    # torchrun started 8 ranks on the 8 GPUs; the 2 engines of TP2 need 4 more
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    code = _main([RECIPE, DISAGG, "rollout.num_engines=2", "trainer.n_gpus_per_node=8", *files, "--cfg"])
    err = capsys.readouterr().err
    assert code == 2 and "trainer on 8: 2 engine(s) x TP 2 = 4 GPUs do not fit the 0 GPUs left after the trainer's 8" \
        in err, err
    assert "start fewer trainer ranks (at most 4" in err


def test_cfg_places_colocated_engines_on_every_node_and_refuses_beyond_the_trainers_gpus(builds, files, capsys):
    """8 engines of TP2 on 2 nodes x 8 GPUs: 4 per node, each mapping the trainer rank on its own GPU (before: refused,
    every engine had to be on rank 0's node); 9 engines would need 18 of the trainer's 16 GPUs: refused."""
    assert _main([RECIPE, "rollout.num_engines=8", "trainer.nnodes=2", "trainer.n_gpus_per_node=8", *files,
                  "--cfg"]) == 0
    capsys.readouterr()
    code = _main([RECIPE, "rollout.num_engines=9", "trainer.nnodes=2", "trainer.n_gpus_per_node=8", *files, "--cfg"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert ("rollout.mode=colocated with rollout.num_engines=9 x rollout.tensor_model_parallel_size=2 on 16 GPUs "
            "(trainer.nnodes x trainer.n_gpus_per_node = 2 x 8), trainer on 16: 9 engine(s) x TP 2 = 18 GPUs do not "
            "fit the trainer's 16 GPUs") in err
    assert "rollout.num_engines to 8 or less, or use rollout.mode=disaggregated" in err
    assert builds == []


# --------------------------------------------------------------------------- the start of a run


def test_run_refuses_before_building_anything(builds, files, capsys, monkeypatch):
    """torchrun.sh with all 8 GPUs (8 ranks) and disaggregated engines: refused at the config check, with the
    GPU count of this machine (8, patched) when trainer.n_gpus_per_node is null; trainer.run never called."""
    import rlhf.launcher

    monkeypatch.setattr(rlhf.launcher, "_cuda_count", lambda: 8)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    code = _main([RECIPE, DISAGG, *files])
    err = capsys.readouterr().err
    assert code == 2 and "(nodes x GPUs per node (trainer.n_gpus_per_node=null) = 1 x 8), trainer on 8" in err, err
    assert builds == []
    # colocated 8 ranks with its 4 engines of TP2: passes the checks and reaches trainer.run
    assert _main([RECIPE, *files]) == 0 and len(builds) == 1


# --------------------------------------------------------------------------- --plan-memory


def test_plan_memory_refuses_disaggregated_7b_with_no_gpu_left(builds, files, capsys):
    code = _main([RECIPE, DISAGG, files[0], "trainer.n_gpus_per_node=8", "--plan-memory=80"])
    out = capsys.readouterr()
    assert code == 2 and "leave none for the trainer" in out.err and "fits" not in out.out
    # the report itself (trainer.n_gpus_per_node null: 8 GPUs per node without CUDA) refuses too
    cfg = compose_config([DISAGG], recipe="gsm8k_ppo_qwen2_7b")
    code, text = plan_memory_report(cfg, 80, hf_config=QWEN2_7B)
    assert code == 2 and text.startswith("cannot plan memory: rollout.mode=disaggregated: rollout.num_engines x "
                                         "rollout.tensor_model_parallel_size = 8 GPUs of the 8") and \
        "leave none for the trainer" in text, text
    # through rlhf.main with trainer.n_gpus_per_node null: the config check on the planned 8 GPUs refuses first
    assert _main([RECIPE, DISAGG, files[0], "--plan-memory=80"]) == 2
    assert "leave none for the trainer" in capsys.readouterr().err
    assert builds == []


def test_plan_memory_plans_the_trainer_gpus_the_engines_leave(builds, files, capsys):
    # (micro batches of 4: at DP1 the logits of 8 sequences and the trainer's NCCL communicators leave no room)
    code = _main([RECIPE, DISAGG, "rollout.num_engines=2", "actor.log_prob_micro_batch_size_per_gpu=8",
                  "actor.ppo_micro_batch_size_per_gpu=4", files[0], "trainer.n_gpus_per_node=8", "--plan-memory=80"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.startswith("4 GPUs of 80 GiB (trainer.n_gpus_per_node x trainer.nnodes less the engines 4;")
    assert "TP4 PP1 DP1" in out and out.rstrip().endswith("fits")
    assert builds == []


def test_plan_memory_refuses_colocated_engines_beyond_the_trainers_gpus(builds, files, capsys):
    code = _main([RECIPE, "rollout.num_engines=9", "trainer.nnodes=2", "trainer.n_gpus_per_node=8", files[0],
                  "--plan-memory=80"])
    assert code == 2 and "do not fit the trainer's 16 GPUs" in capsys.readouterr().err
    # trainer.n_gpus_per_node null: the GPUs per node the plan assumes (8 without CUDA)
    code = _main([RECIPE, "rollout.num_engines=9", "trainer.nnodes=2", files[0], "--plan-memory=80"])
    err = capsys.readouterr().err
    assert code == 2 and "on 16 GPUs (trainer.nnodes x GPUs per node (trainer.n_gpus_per_node=null) = 2 x 8)" in err
    assert "do not fit the trainer's 16 GPUs" in err and "rollout.mode=disaggregated" in err
    assert builds == []

@pytest.mark.parametrize("mode", ["trainer.one_step_off_policy", "async_training"])
def test_one_step_off_with_colocated_engines_is_refused_on_gpus(mode, builds, files, capsys, monkeypatch):
    """One step off-policy keeps colocated engines resident while the actor trains: on a GPU machine (8 GPUs,
    patched) the start refuses it before building anything, pointing at verl's pool keys (verl asserts
    hybrid_engine=False); on CPU it runs (tests/e2e/test_async_rl_e2e.py)."""
    import rlhf.launcher

    monkeypatch.setattr(rlhf.launcher, "_cuda_count", lambda: 8)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    code = _main([RECIPE, *files, f"{mode}.enable=true"])
    err = capsys.readouterr().err
    assert code == 2 and f"{mode}.enable=true with colocated engines on GPUs" in err, err
    assert "actor_rollout_ref.hybrid_engine=False with rollout.nnodes / rollout.n_gpus_per_node" in err
    assert builds == []
    monkeypatch.setattr(rlhf.launcher, "_cuda_count", lambda: 0)  # a CPU machine: reaches trainer.run
    assert _main([RECIPE, *files, f"{mode}.enable=true"]) == 0 and len(builds) == 1

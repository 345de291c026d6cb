"""The memory plan wired in: ``python -m rlhf.main ... --plan-memory``, the trainer's start check, and every GPU
recipe's plan (its README shows it, and it fits the recipe's stated GPUs)."""
import glob
import json
import logging
import os
import re

import pytest

from rlhf.memory_plan.planner import GiB
from rlhf.memory_plan.cli import check_plan_at_start, plan_memory_report
from rlhf.memory_plan.from_config import MemoryPlanError, plan_from_config
from tests.unit.memory_plan.test_memory_plan import QWEN2_7B

from tests.support.paths import ROOT
STATED = re.compile(r"Stated GPUs: (\d+) x (\d+) GiB")
#: a Qwen3-30B-A3B-shaped config.json (the public config's shape, no weights) and the layout its README plan uses
QWEN3_30B_A3B = json.load(open(os.path.join(ROOT, "tests", "support", "fixtures", "qwen3_30b_a3b", "config.json")))
MOE_LAYOUT = ["parallel.expert_model_parallel_size=8"]
#: GPU recipe -> the config.json its README's plan reads (Qwen2-7B's unless named here)
QWEN2_5_3B = json.load(open(os.path.join(ROOT, "tests", "support", "fixtures", "qwen2_5_3b", "config.json")))
HF_CONFIGS = {"gsm8k_multiturn_qwen2_5_3b": QWEN2_5_3B}


def offload_overrides(cfg) -> list[str]:
    """Every offload switch of the roles `cfg` builds (actor; reference with a KL term or DPO; critic under gae)."""
    out = [f"actor.offload.{p}=true" for p in ("params", "grads", "optimizer")]
    if cfg.algorithm.name == "dpo" or cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss:
        out.append("actor.ref_param_offload=true")
    if cfg.algorithm.name != "dpo" and (cfg.critic.enable if cfg.critic.enable is not None
                                        else cfg.algorithm.adv_estimator == "gae"):
        out += [f"critic.offload.{p}=true" for p in ("params", "grads", "optimizer")]
    return out


def _recipes():
    return sorted(os.path.basename(f)[:-5] for f in glob.glob(os.path.join(ROOT, "recipes/*/*.yaml"))
                  if not f.split(os.sep)[-2].startswith("_"))


@pytest.fixture(scope="module")
def composed():
    from rlhf.config import compose_config

    return {r: compose_config([], recipe=r) for r in _recipes()}


def gpu_recipes(composed):
    """Recipes that train a real model (not tiny://): the GPU recipes."""
    return [r for r, c in composed.items() if not str(c.model.path).startswith("tiny://")]


@pytest.fixture()
def qwen2_7b_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_7B))  # config.json alone: no weights are read
    return str(tmp_path)


def test_plan_memory_prints_the_table_and_exits_0(qwen2_7b_dir, capsys):
    from rlhf.main import main

    code = main(["recipe=gsm8k_ppo_qwen2_7b", f"model.path={qwen2_7b_dir}", "trainer.n_gpus_per_node=8",
                 "--plan-memory=80"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.startswith("8 GPUs of 80 GiB")
    # the hand-checked PPO numbers of tests/unit/memory_plan/test_memory_plan.py::test_ppo_7b_numbers, through the CLI
    assert re.search(r"^build\s+32\.3\s", out, re.M) and re.search(r"^generate\s+74\.6\s", out, re.M), out
    assert out.rstrip().endswith("fits")


def test_plan_memory_exits_2_with_the_knob_when_it_does_not_fit(qwen2_7b_dir, capsys):
    from rlhf.main import main

    code = main(["recipe=gsm8k_ppo_qwen2_7b", f"model.path={qwen2_7b_dir}", "trainer.n_gpus_per_node=8",
                 "--plan-memory=40"])
    out = capsys.readouterr().out
    assert code == 2
    assert "DOES NOT FIT" in out and "40 GiB" in out
    assert "mem_fraction_static" in out or "parallel." in out  # the knob to turn


def test_plan_memory_without_a_config_json_exits_2(capsys):
    from rlhf.main import main

    assert main(["recipe=quickstart", "--plan-memory"]) == 2
    err = capsys.readouterr().err
    assert "cannot plan memory" in err and "model.path=<an HF model directory" in err
    assert main(["recipe=quickstart", "--plan-memory=lots"]) == 2
    assert "--plan-memory=80" in capsys.readouterr().err


def test_report_world_size_from_the_config(composed):
    code, text = plan_memory_report(composed["grpo_qwen2_7b"], 80, hf_config=QWEN2_7B, world_size=16)
    assert code == 0 and text.startswith("16 GPUs of 80 GiB") and "DP4" in text
    code, text = plan_memory_report(composed["grpo_qwen2_7b"], 80, hf_config=QWEN2_7B, world_size=6)
    assert code == 2 and "does not divide world_size=6" in text


def test_start_check_cpu_is_silent_gpu_warns_with_the_knob(composed, caplog):
    cfg = composed["gsm8k_ppo_qwen2_7b"]
    with caplog.at_level(logging.DEBUG, logger="rlhf.memory_plan.cli"):
        assert check_plan_at_start(cfg, QWEN2_7B, world_size=8, cuda=False) is None
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
    caplog.clear()
    # on a GPU the size of this machine's first device (none here: the 80 GiB default) -> fits, nothing logged
    with caplog.at_level(logging.WARNING):
        plan = check_plan_at_start(cfg, QWEN2_7B, world_size=8, cuda=True)
    assert plan is not None and plan.fits and not caplog.records
    # too few GPUs for the model: a warning with the table and the knobs, or a refusal when strict
    with caplog.at_level(logging.WARNING):
        plan = check_plan_at_start(cfg, QWEN2_7B, world_size=4, cuda=True)
    assert not plan.fits and "DOES NOT FIT" in caplog.text and "needs" in caplog.text
    with pytest.raises(MemoryPlanError, match="does not fit in GPU memory"):
        check_plan_at_start(cfg, QWEN2_7B, world_size=4, cuda=True, strict=True)


def test_every_gpu_recipe_fits_its_stated_gpus_and_its_readme_shows_the_plan(composed):
    recipes = gpu_recipes(composed)
    assert len(recipes) >= 4, recipes
    for r in recipes:
        path = os.path.join(ROOT, "recipes", r, "README.md")
        assert os.path.isfile(path), f"{r}: no recipes/{r}/README.md with its memory plan"
        text = open(path, encoding="utf-8").read()
        m = STATED.search(text)
        assert m, f"{path}: no 'Stated GPUs: N x G GiB' line"
        gpus, gib = int(m.group(1)), int(m.group(2))
        hf = HF_CONFIGS.get(r, QWEN2_7B)
        plan = plan_from_config(composed[r], hf, world_size=gpus, gpu_memory_gib=gib)
        assert plan.fits, f"{r} on {gpus} x {gib} GiB:\n" + "\n".join(plan.knobs())
        code, table = plan_memory_report(composed[r], gib, hf_config=hf, world_size=gpus)
        assert code == 0 and table in text, f"{path}: the plan block is stale; regenerate it:\n{table}"
        assert plan.peak.peak < (gib - 5) * GiB  # 5 GiB of headroom for what the plan does not model


def test_readmes_show_what_offload_buys(composed):
    """Each GPU recipe's README shows its plan with every offload on (kept in step with the planner): the engine
    measures more free memory at start and nothing of the trainer stays resident while it generates; the
    Qwen3-30B-A3B-shaped plans (grpo_qwen2_7b's README) without and with offload."""
    from rlhf.config import compose_config
    from rlhf.memory_plan.from_config import plan_input_from_config
    from rlhf.memory_plan.planner import plan_memory

    for r in gpu_recipes(composed):
        text = open(os.path.join(ROOT, "recipes", r, "README.md"), encoding="utf-8").read()
        over = offload_overrides(composed[r])
        assert f"recipe={r} trainer.n_gpus_per_node=8 {' '.join(over)} --plan-memory=80" in text, r
        off, hf = compose_config(over, recipe=r), HF_CONFIGS.get(r, QWEN2_7B)
        code, table = plan_memory_report(off, 80, hf_config=hf, world_size=8)
        assert code == 0 and table in text, f"{r}: the offload plan block is stale; regenerate it:\n{table}"
        plain = plan_from_config(composed[r], hf, world_size=8, gpu_memory_gib=80)
        lean = plan_from_config(off, hf, world_size=8, gpu_memory_gib=80)
        if plain.engine_free_at_start:  # (DPO has no engine)
            assert lean.engine_free_at_start > plain.engine_free_at_start and lean.kv_cache_bytes > plain.kv_cache_bytes
            assert not [i for i in lean.phase("generate").items if i.name.startswith(("actor", "critic", "reference"))]
        assert lean.phase("actor fwd/bwd").peak <= plain.phase("actor fwd/bwd").peak
    grpo = open(os.path.join(ROOT, "recipes", "grpo_qwen2_7b", "README.md"), encoding="utf-8").read()
    for over in ([], offload_overrides(composed["grpo_qwen2_7b"])):
        cfg = compose_config([*MOE_LAYOUT, *over], recipe="grpo_qwen2_7b")
        code, table = plan_memory_report(cfg, 80, hf_config=QWEN3_30B_A3B, world_size=8)
        assert code == 0 and table in grpo, f"the Qwen3-30B-A3B plan block is stale; regenerate it:\n{table}"
    moe = plan_input_from_config(compose_config(MOE_LAYOUT, recipe="grpo_qwen2_7b"), QWEN3_30B_A3B, world_size=8)
    assert moe.model.num_experts == 128 and moe.model.moe_topk == 8
    assert plan_memory(moe).phases  # the fixture plans


def test_offload_and_megatron_optimizer_options_in_the_plan(composed):
    """Hand values on grpo_qwen2_7b (actor + reference, TP4 DP2, bf16): each offloaded part leaves the resident
    items and comes back (loaded from host) exactly in its role's phases; megatron's optimizer_cpu_offload
    keeps its fraction of main params + moments on host; bf16 moments halve them."""
    from rlhf.config import compose_config

    def items(overrides, phase):
        plan = plan_from_config(compose_config(overrides, recipe="grpo_qwen2_7b"), QWEN2_7B, world_size=8)
        return {i.name: i.bytes for i in plan.phase(phase).items}

    base = items([], "generate")
    grads_only = items(["actor.offload.grads=true"], "generate")
    assert "actor grads" not in grads_only and grads_only["actor adam"] == base["actor adam"]
    assert items(["actor.offload.grads=true"], "actor fwd/bwd")["actor grads (loaded from host)"] == base["actor grads"]
    assert items(["actor.ref_param_offload=true"], "reference log-probs")["reference weights (loaded from host)"] \
        == base["reference weights"]
    assert "reference weights" not in items(["actor.ref_param_offload=true"], "actor log-probs")
    half = items(["actor.optim.optimizer_cpu_offload=true", "actor.optim.optimizer_offload_fraction=0.5"], "generate")
    assert half["actor adam"] == pytest.approx(base["actor adam"] / 2)
    assert half["actor main params"] == pytest.approx(base["actor main params"] / 2)
    bf16 = items(["actor.optim.use_precision_aware_optimizer=true", "actor.optim.exp_avg_dtype=bf16",
                  "actor.optim.exp_avg_sq_dtype=bf16"], "generate")
    # (the recipe's distributed optimizer shards them already): 2 + 2 bytes per moment element instead of 4 + 4
    assert bf16["actor adam"] == pytest.approx(base["actor adam"] / 2)


def test_production_guide_4x8_checkpoint_save_fits(qwen2_7b_dir, capsys):
    """The production guide's deployment (docs/verl.md: 4 nodes x 8 GPUs, rollout TP 2: 16 colocated engines) of
    gsm8k_ppo_qwen2_7b: the checkpoint save gathers the actor's TP4 shard over DP 8, 4 x 1,904,057,344 x 9/8
    bytes = 7.98 GiB, with the engines released (test_memory_plan.py::test_checkpoint_save_phase_by_hand)."""
    from rlhf.main import main

    code = main(["recipe=gsm8k_ppo_qwen2_7b", f"model.path={qwen2_7b_dir}", "trainer.nnodes=4",
                 "trainer.n_gpus_per_node=8", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                 "--plan-memory=80"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("32 GPUs of 80 GiB") and "DP8" in out, out
    save = re.search(r"^checkpoint save\s+([\d.]+)\s+[\d.]+\s+ok\s+actor distributed-optimizer state gathered over "
                     r"DP \(fp32, one state at a time\) ([\d.]+)", out, re.M)
    assert save, out
    assert float(save.group(2)) == pytest.approx(4 * 1904057344 * 9 / 8 / GiB, abs=0.05)
    assert float(save.group(1)) == pytest.approx(44.7, abs=0.05)
    assert out.rstrip().endswith("fits")


def test_plan_memory_shows_the_teacher(tmp_path, capsys):
    """--plan-memory with distillation reads the teacher's config.json too: a teacher on its own TP4 grid is a row of
    the build phase and a phase of its own; a teacher without a config.json is named."""
    from rlhf.main import main

    (tmp_path / "student").mkdir()
    (tmp_path / "teacher").mkdir()
    (tmp_path / "student" / "config.json").write_text(json.dumps(QWEN2_7B))
    (tmp_path / "teacher" / "config.json").write_text(json.dumps({**QWEN2_7B, "num_hidden_layers": 56}))
    args = ["recipe=grpo_qwen2_7b", f"model.path={tmp_path / 'student'}", "trainer.n_gpus_per_node=8",
            "distill.enable=true"]
    build = lambda text: float(re.search(r"^build\s+([\d.]+)\s", text, re.M).group(1))  # noqa: E731
    main(args[:-1] + ["--plan-memory=80"])
    alone = build(capsys.readouterr().out)
    main(args + [f"distill.teacher.path={tmp_path / 'teacher'}", "distill.teacher.tensor_model_parallel_size=8",
                 "--plan-memory=80"])
    out = capsys.readouterr().out
    assert "roles: actor, reference, teacher" in out and re.search(r"^teacher log-probs ", out, re.M), out
    # 56 layers of Qwen2-7B's shape at TP8: (56 x 233.06M + 2 x 152064 x 3584) / 8 elements, bf16: 3.29 GiB
    assert build(out) - alone == pytest.approx(3.29, abs=0.1), out  # the table rounds to 0.1 GiB
    assert main(args + ["distill.teacher.path=tiny://quickstart", "--plan-memory=80"]) == 2
    assert "distill.teacher.path='tiny://quickstart' has no config.json" in capsys.readouterr().err

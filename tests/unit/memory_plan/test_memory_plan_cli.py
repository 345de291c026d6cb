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
    assert re.search(r"^build\s+32\.2\s", out, re.M) and re.search(r"^generate\s+72\.1\s", out, re.M), out
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
        plan = plan_from_config(composed[r], QWEN2_7B, world_size=gpus, gpu_memory_gib=gib)
        assert plan.fits, f"{r} on {gpus} x {gib} GiB:\n" + "\n".join(plan.knobs())
        code, table = plan_memory_report(composed[r], gib, hf_config=QWEN2_7B, world_size=gpus)
        assert code == 0 and table in text, f"{path}: the plan block is stale; regenerate it:\n{table}"
        assert plan.peak.peak < (gib - 5) * GiB  # 5 GiB of headroom for what the plan does not model

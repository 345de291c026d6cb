"""The installed package (a wheel, not the checkout): both top-level packages import, `parallel` from the wheel,
and every recipe is found by name with its launch scripts (recipes/ ships beside rlhf/)."""
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.support.paths import REPO

PROBE = r"""
import os, sys
sys.path.insert(0, sys.argv[1])  # the unpacked wheel first: not the checkout, not the editable install
import parallel, rlhf
from rlhf.config import compose_config, list_recipes
from rlhf.config.compose import recipe_files
assert parallel.__file__.startswith(sys.argv[1]), parallel.__file__
assert rlhf.__file__.startswith(sys.argv[1]), rlhf.__file__
names = list_recipes()
assert "quickstart" in names and "grpo_qwen2_7b" in names, names
for name, path in recipe_files().items():
    assert str(path).startswith(sys.argv[1]), path
    for script in ("run_torchrun.sh", "run_slurm.sbatch"):
        assert os.path.isfile(os.path.join(os.path.dirname(path), script)), (name, script)
cfg = compose_config(recipe="grpo_qwen2_7b")
print("OK", len(names), cfg.algorithm.adv_estimator, cfg.trainer.experiment_name)
"""


@pytest.mark.slow
def test_wheel_has_parallel_and_every_recipe(tmp_path):
    # built from a copy of the tracked files: no build/ left in the checkout, nothing untracked in the wheel
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        if os.path.isfile(REPO / rel):
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp_path / "wheel"), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    [wheel] = list((tmp_path / "wheel").glob("*.whl"))
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("parallel/") for n in names) and any(n.startswith("recipes/_base/") for n in names)
    assert "recipes/gsm8k_multiturn_qwen2_5_3b/tool_config/gsm8k_tool_config.yaml" in names  # a recipe's tool config
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", PROBE, str(target)], cwd=str(tmp_path), capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[:1] == ["OK"] and "grpo qwen2_7b_grpo" in r.stdout, r.stdout

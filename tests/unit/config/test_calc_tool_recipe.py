"""Recipe calc_tool_tiny_cpu (recipes/calc_tool_tiny_cpu): composes at --cfg with multi-turn on and its tool config
(verl's layout, the calculator) checked; from another directory its relative tool config path is read from the repository root, and a missing one
is refused at --cfg (exit 2) naming the path and both directories it was looked for in."""
from __future__ import annotations

from rlhf.config import compose_config, validate_config
from rlhf.main import main
from tests.support.paths import REPO


def test_recipe_composes_at_cfg(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)  # the recipe's tool_config_path is relative to the repository root
    assert main(["recipe=calc_tool_tiny_cpu", f"trainer.default_local_dir={tmp_path}", "--cfg", "job"]) == 0
    out = capsys.readouterr().out
    assert "multi_turn:\n    enable: true\n    max_assistant_turns: 2\n" in out
    assert "tool_config_path: recipes/calc_tool_tiny_cpu/tool_config/calc_tool_config.yaml\n" in out
    assert "path: tiny://calc\n" in out and "train_files: embedded://calc\n" in out
    cfg = compose_config([f"trainer.default_local_dir={tmp_path}"], recipe="calc_tool_tiny_cpu")
    validate_config(cfg, world_size=1, check_files=True)
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.rollout.n == 4


def test_tool_config_path_resolves_from_elsewhere_and_a_missing_one_is_refused(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # relative and absent from the CWD: read from the repository root
    assert main(["recipe=calc_tool_tiny_cpu", f"trainer.default_local_dir={tmp_path}", "--cfg", "job"]) == 0
    capsys.readouterr()
    bad = "recipes/calc_tool_tiny_cpu/tool_config/no_such.yaml"
    assert main(["recipe=calc_tool_tiny_cpu", f"actor_rollout_ref.rollout.multi_turn.tool_config_path={bad}",
                 "--cfg", "job"]) == 2
    err = capsys.readouterr().err
    assert f"{bad!r} is not a file (relative paths are read from {tmp_path} and the repository root {REPO}" in err, err

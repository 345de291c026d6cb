"""Checkpoint UX: which checkpoint a run resumes from (trainer.resume_from_path: a step directory, a
checkpoints directory for its latest, a run directory; verl's resume_mode=resume_path spelling), bad paths
refused at --cfg and at the trainer's start before anything is built, a hint for --ckpt_path style typos, the
log lines of a save, and verl's default lr_decay_steps (the whole run)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from rlhf import main as entry
from rlhf.config import ConfigKeyError, compose_config
from rlhf.resume import STATE_FILE, TRACKER, resolve_resume_path
from rlhf.trainer import base

HINT = "trainer.resume_from_path=<run>/checkpoints/global_step_N"


def _checkpoint(root, step, complete=True, tracker=True):
    d = root / f"global_step_{step}"
    d.mkdir(parents=True)
    if complete:
        (d / STATE_FILE).write_bytes(b"")
    if tracker:
        (root / TRACKER).write_text(str(step))
    return str(d)


def test_resume_from_a_step_a_checkpoints_root_or_a_run_directory(tmp_path):
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    _checkpoint(ckpts, 2)
    step4 = _checkpoint(ckpts, 4)
    step2 = str(ckpts / "global_step_2")
    for mode in ("auto", "resume_path"):  # ours and verl's spelling
        assert resolve_resume_path(mode, step2, "elsewhere") == step2  # a step directory: that one
        assert resolve_resume_path(mode, str(ckpts), "elsewhere") == step4  # the checkpoints root: its latest
        assert resolve_resume_path(mode, str(run), "elsewhere") == step4  # the run directory: its latest
    assert resolve_resume_path("auto", None, str(run)) == step4  # no path: the latest of default_local_dir
    assert resolve_resume_path("auto", None, str(tmp_path / "fresh")) is None  # nothing yet: start fresh
    assert resolve_resume_path("disable", None, str(run)) is None


@pytest.mark.parametrize("case, expect", [
    ("missing", "no such directory"), ("empty_root", "holds no checkpoint"),
    ("no_tracker", "holds global_step_3 but no latest_checkpointed_iteration.txt"),
    ("incomplete", "not a complete checkpoint"), ("foreign", "has no trainer_state.pt"), ("file", "is a file")])
def test_a_bad_resume_path_names_the_fix(tmp_path, case, expect):
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    path = {"missing": str(tmp_path / "nope" / "global_step_9"), "empty_root": str(ckpts)}.get(case)
    if case == "no_tracker":
        _checkpoint(ckpts, 3, tracker=False)
        path = str(ckpts)
    elif case == "incomplete":
        path = _checkpoint(ckpts, 5, complete=False)
    elif case == "foreign":  # e.g. a verl checkpoint: a tracker and a folder, not our trainer state
        _checkpoint(ckpts, 6, complete=False)
        path = str(ckpts)
    elif case == "file":
        (tmp_path / "ckpt.pt").write_bytes(b"")
        path = str(tmp_path / "ckpt.pt")
    with pytest.raises(FileNotFoundError) as e:
        resolve_resume_path("auto", path, str(tmp_path))
    assert expect in str(e.value) and f"trainer.resume_from_path={path!r}" in str(e.value)
    if case != "incomplete":
        assert HINT in str(e.value)
    with pytest.raises(ValueError, match="resume_mode=resume_path needs a checkpoint; to resume, set " + HINT):
        resolve_resume_path("resume_path", None, str(tmp_path))


def test_cfg_refuses_a_resume_path_with_no_checkpoint(tmp_path, capsys):
    code = entry.main(["recipe=quickstart", f"trainer.resume_from_path={tmp_path}", "--cfg"])
    err = capsys.readouterr().err
    assert code == entry.EXIT_CONFIG_ERROR and f"trainer.resume_from_path={str(tmp_path)!r} holds no checkpoint" in err
    assert HINT in err


def test_the_trainer_refuses_it_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(base, "init_distributed", lambda: pytest.fail("distributed init before the resume check"))
    cfg = compose_config([f"trainer.resume_from_path={tmp_path / 'typo'}"], recipe="quickstart")
    with pytest.raises(FileNotFoundError, match="no such directory"):
        base.BaseTrainer(cfg)


def test_ckpt_path_style_typos_point_at_resume_from_path(capsys):
    assert entry.main(["recipe=quickstart", "--ckpt_path", "/x"]) == entry.EXIT_CONFIG_ERROR
    assert "unknown option '--ckpt_path'; to resume, set " + HINT in capsys.readouterr().err
    for key in ("trainer.ckpt_path", "trainer.resume_from_checkpoint", "load_checkpoint"):
        with pytest.raises(ConfigKeyError) as e:
            compose_config([f"{key}=/x"])
        assert HINT in str(e.value), key
    with pytest.raises(ConfigKeyError) as e:  # other typos get no resume hint
        compose_config(["trainer.totl_epochs=2"])
    assert HINT not in str(e.value)


def _trainer(tmp_path, **trainer):
    t = object.__new__(base.BaseTrainer)
    t.cfg = compose_config([f"trainer.default_local_dir={tmp_path}"] + [f"{k}={v}" for k, v in trainer.items()])
    t.hf_config = SimpleNamespace()
    t.trainer_state = lambda: {}
    t.checkpoint_roles = lambda: {}
    return t


def test_each_save_logs_its_path(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(base.dist, "get_rank", lambda: 0)
    saved = []
    monkeypatch.setattr(base, "save_checkpoint_dir", lambda root, step, *a, **k:
                        saved.append(step) or os.path.join(root, f"global_step_{step}"))
    with caplog.at_level("INFO", logger="rlhf.trainer.base"):
        path = _trainer(tmp_path).save_checkpoint(7)
    out = caplog.messages
    assert saved == [7] and path == str(tmp_path / "checkpoints" / "global_step_7")
    assert out[0] == f"saving checkpoint to {path}"
    assert out[1].startswith(f"saved checkpoint {path} (step 7, ")
    assert out[1].endswith(f"trainer.resume_from_path={path}")


def test_lr_decay_steps_null_decays_over_the_run(tmp_path, monkeypatch, caplog):
    """verl's get_megatron_optimizer_param_scheduler: lr_decay_steps null -> the run's length.  Here in optimizer
    steps: 5 updates x (train batch 8 / mini batch 4) x 2 epochs = 20."""
    monkeypatch.setattr(base.dist, "get_rank", lambda: 0)
    t = _trainer(tmp_path, **{"data.train_batch_size": 8, "actor.ppo_mini_batch_size": 4,
                              "actor.optim.lr_decay_style": "cosine"})
    with caplog.at_level("INFO", logger="rlhf.trainer.base"):
        t.fill_lr_decay_steps("actor", updates=5, epochs=2)
    assert t.cfg.actor.optim.lr_decay_steps == 20 and "decaying over the run's 20 optimizer steps" in caplog.text
    t.fill_lr_decay_steps("critic", updates=5, epochs=1)  # constant schedule: nothing to decay
    assert t.cfg.critic.optim.lr_decay_steps is None
    t = _trainer(tmp_path, **{"actor.optim.lr_decay_style": "linear", "actor.optim.lr_decay_steps": 3})
    t.fill_lr_decay_steps("actor", updates=5, epochs=1)
    assert t.cfg.actor.optim.lr_decay_steps == 3  # the user's value stays

"""rlhf/trainer/checkpoint.py: the common state megatron saves is loadable with torch.load(weights_only=True)
(the scheduler state holds the config's StrEnum lr_decay_style), the tracker / latest-checkpoint rules, and the
rotation by write order (an earlier run's higher steps never delete the checkpoint just written)."""
from __future__ import annotations

import io
import os

import pytest
import torch

from parallel.optim_config import LRDecayStyle
from rlhf.resume import STATE_FILE, resolve_resume_path
from rlhf.trainer import checkpoint as ckpt
from rlhf.trainer.checkpoint import TRACKER, latest_checkpoint, to_builtins


def test_enums_become_builtins_and_load_weights_only():
    state = {"lr_decay_style": LRDecayStyle.cosine, "num_steps": 3, "guard": {"streak": [1.5, 2.0]},
             "pair": (LRDecayStyle.linear, 1)}
    with pytest.raises(Exception, match="Weights only load failed"):
        buf = io.BytesIO()
        torch.save(state, buf)
        torch.load(io.BytesIO(buf.getvalue()))
    plain = to_builtins(state)
    assert plain == {"lr_decay_style": "cosine", "num_steps": 3, "guard": {"streak": [1.5, 2.0]},
                     "pair": ("linear", 1)}
    assert type(plain["lr_decay_style"]) is str and type(plain["pair"][0]) is str
    buf = io.BytesIO()
    torch.save(plain, buf)
    assert torch.load(io.BytesIO(buf.getvalue())) == plain  # weights_only=True is torch's default


def test_latest_checkpoint_follows_the_tracker(tmp_path):
    assert latest_checkpoint(str(tmp_path)) is None
    (tmp_path / "global_step_4").mkdir()
    (tmp_path / TRACKER).write_text("4")
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "global_step_4")
    (tmp_path / TRACKER).write_text("6")  # tracker ahead of a folder that is gone: nothing to resume
    assert latest_checkpoint(str(tmp_path)) is None


# ----------------------------------------------------------------------------- rotation by write order

def _save(monkeypatch, root, step, max_to_keep=2):
    """rlhf.trainer.checkpoint.save_checkpoint on one rank (no roles: the trainer state, the RNG and the rotation)."""
    monkeypatch.setattr(ckpt.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(ckpt.dist, "barrier", lambda: None)
    return ckpt.save_checkpoint(str(root), step, {}, {"train_loader": None}, max_to_keep)


def _steps(root):
    return sorted(int(n.split("_")[-1]) for n in os.listdir(root) if n.startswith("global_step_"))


@pytest.mark.parametrize("earlier", ["saved_here", "without_write_order"])
def test_a_new_save_survives_an_earlier_runs_higher_steps_and_auto_resume_finds_it(tmp_path, monkeypatch, caplog,
                                                                                  earlier):
    """An earlier run left global_step_50 and global_step_100 in trainer.default_local_dir; this run
    (resume_mode=disable, or resume_from_path at an older checkpoint) saves step 10 with max_ckpt_to_keep=2.
    By step, 10 was the oldest and was deleted as soon as written, and resume_mode=auto found nothing (step 0).
    By write order the earlier run's oldest (50) goes, 10 stays, and auto-resume finds it."""
    run = tmp_path / "run"
    root = run / "checkpoints"
    if earlier == "saved_here":
        _save(monkeypatch, root, 50)
        _save(monkeypatch, root, 100)
    else:  # checkpoints from before write_order.txt existed (or copied in): older than every new write
        for step in (50, 100):
            (root / f"global_step_{step}").mkdir(parents=True)
            (root / f"global_step_{step}" / STATE_FILE).write_bytes(b"")
        (root / TRACKER).write_text("100")
    assert resolve_resume_path("auto", None, str(run)) == str(root / "global_step_100")
    with caplog.at_level("WARNING", logger="rlhf.trainer.checkpoint"):
        path = _save(monkeypatch, root, 10)
    assert path == str(root / "global_step_10") and os.path.isfile(os.path.join(path, STATE_FILE))
    assert _steps(root) == [10, 100]  # the new checkpoint survives; the earlier run's oldest write went
    assert resolve_resume_path("auto", None, str(run)) == path  # what resume_mode=auto resumes from
    assert "deleted checkpoints global_step_50 of" in caplog.text  # an earlier run's higher step: said so
    caplog.clear()
    with caplog.at_level("WARNING", logger="rlhf.trainer.checkpoint"):
        _save(monkeypatch, root, 20)
    assert _steps(root) == [10, 20] and resolve_resume_path("auto", None, str(run)) == str(root / "global_step_20")
    assert "deleted checkpoints global_step_100" in caplog.text and "trainer.default_local_dir" in caplog.text
    assert torch.load(os.path.join(root, "global_step_20", STATE_FILE), weights_only=False)["step"] == 20


def test_rotation_keeps_the_last_writes_and_never_the_one_just_written(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        _save(monkeypatch, root, step)
    assert _steps(root) == [2, 3]  # a plain run: the last two steps, as before
    _save(monkeypatch, root, 2)  # a rerun from step 1 saves step 2 again: replaced, the newest write
    assert _steps(root) == [2, 3] and (root / "global_step_2" / ckpt.WRITE_ORDER).read_text() == "4"  # 1 + 3 (global_step_3)
    _save(monkeypatch, root, 4, max_to_keep=1)
    assert _steps(root) == [4]
    assert ckpt.rotate(str(root), 1, keep=4) == [] and _steps(root) == [4]
    _save(monkeypatch, root, 5, max_to_keep=None)  # null keeps all
    assert _steps(root) == [4, 5]


def test_a_tracker_naming_a_removed_checkpoint_resumes_from_the_newest_written(tmp_path, caplog):
    """A tracker naming a folder that is gone (the user removed the latest to roll back) resumes from the newest
    complete checkpoint by write order -- before, it returned None and auto-resume silently started at step 0."""
    from rlhf.resume import STATE_FILE, WRITE_ORDER, resolve_resume_path

    root = tmp_path / "checkpoints"
    for step, order in ((8, 1), (2, 2), (4, 3), (6, 4)):  # step 8 is an earlier run's; 6 was written last
        (root / f"global_step_{step}").mkdir(parents=True)
        (root / f"global_step_{step}" / WRITE_ORDER).write_text(str(order))
        if step != 4 and step != 6:
            (root / f"global_step_{step}" / STATE_FILE).write_text("x")
    (root / "global_step_4" / STATE_FILE).write_text("x")  # 6 has no state file: an unfinished save
    (root / TRACKER).write_text("10")
    with caplog.at_level("WARNING"):
        assert latest_checkpoint(str(root)) == str(root / "global_step_4")
    assert "global_step_10, which is not there" in caplog.text and "global_step_4" in caplog.text
    assert resolve_resume_path("auto", None, str(tmp_path)) == str(root / "global_step_4")
    (root / TRACKER).write_text("garbage")
    assert latest_checkpoint(str(root)) == str(root / "global_step_4")
    assert resolve_resume_path("disable", None, str(tmp_path)) is None

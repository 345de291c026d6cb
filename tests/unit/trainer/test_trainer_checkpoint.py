"""rlhf/trainer/checkpoint.py: the common state megatron saves is loadable with torch.load(weights_only=True)
(the scheduler state holds the config's StrEnum lr_decay_style), and the tracker / latest-checkpoint rules."""
from __future__ import annotations

import io

import pytest
import torch

from parallel.optim_config import LRDecayStyle
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

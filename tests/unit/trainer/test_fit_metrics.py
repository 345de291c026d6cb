"""The fit loop's own verl metrics (verl/trainer/ppo/ray_trainer.py fit): training/global_step, training/epoch,
timing_s/testing around the validation and timing_s/save_checkpoint around the save, both in the step's logged
metrics (the save comes before the step is logged, as in verl).  A fake trainer (no engine, no model) through the
real BaseTrainer.fit and Tracking, read back from TensorBoard."""
from __future__ import annotations

import time

from rlhf.config import compose_config
from rlhf.trainer import base
from rlhf.trainer.alerts import Alerts
from tests.support import tracking_readers as read


class _Loader:
    def __init__(self, per_epoch):
        self.per_epoch, self.drawn, self.epoch = per_epoch, 0, 0

    def next_batch(self):  # StatefulPromptLoader's epoch: the pass the batch just drawn is from
        self.epoch, self.drawn = self.drawn // self.per_epoch, self.drawn + 1
        return {}


class _Trainer(base.BaseTrainer):
    def train_step(self, step):
        self.train_loader.next_batch()
        return {"actor/pg_loss": 0.5, "_tokens": 4.0}

    def validate(self):
        time.sleep(0.05)
        return {"val/score": 1.0}

    def save_checkpoint(self, step):
        time.sleep(0.1)
        self.saved.append(step)


def test_global_step_epoch_testing_and_save_times_are_logged(tmp_path, monkeypatch):
    monkeypatch.setattr(base.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(base.dist, "get_world_size", lambda: 1)
    cfg = compose_config([f"trainer.default_local_dir={tmp_path}", "trainer.logger=[tensorboard]",
                          "trainer.val_before_train=false", "trainer.progress_bar=false", "trainer.test_freq=2",
                          "trainer.save_freq=3", "trainer.export_hf_at_end=false"])
    t = object.__new__(_Trainer)
    t.cfg, t.start_step, t.total_steps, t.resume_path, t.tracker = cfg, 0, 4, None, None
    t.alerts, t.train_loader, t.saved = Alerts([], {}, echo=False), _Loader(per_epoch=3), []
    t.fit()
    assert t.saved == [3, 4]
    s = read.tensorboard(str(tmp_path / "tensorboard"))["scalars"]
    assert [s[("training/global_step", k)] for k in (1, 2, 3, 4)] == [1, 2, 3, 4]
    assert [s[("training/epoch", k)] for k in (1, 2, 3, 4)] == [0, 0, 0, 1]  # 3 batches a pass
    assert sorted(k for (tag, k) in s if tag == "timing_s/testing") == [2, 4]
    assert sorted(k for (tag, k) in s if tag == "timing_s/save_checkpoint") == [3, 4]
    assert s[("timing_s/testing", 2)] >= 0.05 and s[("timing_s/save_checkpoint", 3)] >= 0.1

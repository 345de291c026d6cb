"""global_profiler.steps (verl's trainer.profile_steps): a short fit() on CPU with a fake trainer writes one
torch.profiler trace per rank per listed step and none for the others; NVTX ranges only under nsys on CUDA."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from rlhf.config import compose_config
from rlhf.trainer import base, profiling
from rlhf.trainer.alerts import Alerts
from rlhf.trainer.metrics import timer
from rlhf.trainer.profiling import NSYS_ENV, StepProfiler, trace_path


class _Trainer(base.BaseTrainer):
    def train_step(self, step):
        m = {}
        with timer(m, "update_actor"):
            torch.ones(8, 8) @ torch.ones(8, 8)
        return {**m, "_tokens": 4.0}


def _fit(cfg, total_steps, monkeypatch):
    monkeypatch.setattr(base.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(base.dist, "get_world_size", lambda: 1)
    t = object.__new__(_Trainer)
    t.cfg, t.start_step, t.total_steps, t.resume_path, t.tracker = cfg, 0, total_steps, None, None
    t.alerts, t.train_loader = Alerts([], {}, echo=False), SimpleNamespace(epoch=0)
    return t.fit()


def _cfg(tmp_path, *extra):
    return compose_config([f"trainer.default_local_dir={tmp_path}", "trainer.logger=[console]",
                           "trainer.val_before_train=false", "trainer.progress_bar=false",
                           "trainer.export_hf_at_end=false", *extra])


def test_listed_steps_write_one_trace_each_and_no_other_step_does(tmp_path, monkeypatch):
    last = _fit(_cfg(tmp_path, "global_profiler.steps=[1,3]"), 4, monkeypatch)
    root = tmp_path / "profile"  # save_path null: under the run's directory
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) == [
        "global_step_1/rank_0.pt.trace.json", "global_step_3/rank_0.pt.trace.json"]
    events = json.loads((root / "global_step_3" / "rank_0.pt.trace.json").read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)  # the step's work is in its trace
    assert last["timing_s/step"] > 0 and last["perf/total_num_tokens"] == 4.0


def test_verls_profile_steps_and_save_path(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path / "run", "trainer.profile_steps=[2]", f"global_profiler.save_path={tmp_path / 'traces'}")
    assert list(cfg.global_profiler.steps) == [2]
    _fit(cfg, 2, monkeypatch)
    assert [p.name for p in (tmp_path / "traces").rglob("*.json")] == ["rank_0.pt.trace.json"]
    assert (tmp_path / "traces" / "global_step_2").is_dir() and not (tmp_path / "run" / "profile").exists()


def test_no_listed_step_no_trace(tmp_path, monkeypatch):
    _fit(_cfg(tmp_path), 2, monkeypatch)
    assert not (tmp_path / "profile").exists()


def test_bad_profiler_settings_are_refused():
    from rlhf.config import ConfigValidationError, validate_config

    with pytest.raises(ConfigValidationError) as e:
        validate_config(compose_config(["global_profiler.tool=npu", "global_profiler.steps=[0,2]"]))
    assert "global_profiler.tool='npu' is not supported" in str(e.value) and "steps count from 1" in str(e.value)
    with pytest.raises(ValueError, match="tool='npu'"):
        StepProfiler([1], "p", 0, torch.device("cpu"), tool="npu")


@pytest.mark.parametrize("device, env, expect", [
    ("cuda", {NSYS_ENV: "7"}, ["push step_1", "push update_actor", "pop", "pop"]),
    ("cpu", {NSYS_ENV: "7"}, []),  # not a CUDA device
    ("cuda", {}, [])])  # not under nsys
def test_nvtx_ranges_only_under_nsys_on_cuda(monkeypatch, device, env, expect):
    calls = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(f"push {name}"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append("pop"))
    prof = StepProfiler([], "unused", 0, torch.device(device), environ=env)
    with prof.step(1):  # not a listed step: no torch.profiler, NVTX ranges only
        with timer({}, "update_actor"):
            pass
    prof.close()
    with timer({}, "after_the_run"):
        pass
    assert calls == expect and profiling._nvtx_on is False
    assert trace_path("p", 3, 1) == "p/global_step_3/rank_1.pt.trace.json"

"""Metrics tracking: every backend of trainer.logger writes the same scalars (read back from TensorBoard, an
offline wandb run and an mlflow file store), histograms and tables, trainer.log_freq, project / experiment
names; logging with rank and time through tqdm; the known-harmless warnings filtered."""
import io
import logging
import os
import warnings

import pytest

from rlhf.trainer.loggers import markdown_table, mlflow_key
from rlhf.trainer.tracking import Histogram, Table, Tracking
from tests.support import tracking_readers as read

STEPS = {1: {"critic/score/mean": 0.25, "actor/pg_loss": -0.5, "val/openai/gsm8k/pass@4": 0.75},
         2: {"critic/score/mean": 0.5, "actor/pg_loss": 0.125},
         3: {"critic/score/mean": 1.0, "actor/pg_loss": 2.0}}


def _need(module):
    try:
        __import__(module)
    except ImportError:
        pytest.skip(f"{module} is not installed (pip install 'rlhf-megatron-sglang[{module}]', part of [test])")


def _log_all(tracker):
    for step, m in STEPS.items():
        metrics = dict(m)
        if step == 2:
            metrics["critic/score/hist"] = Histogram([0.0, 1.0, 1.0, 0.5])
            metrics["val/generations"] = Table(["prompt", "response", "score"], [["1+1=", "2 | two\nok", 1.0]])
            metrics["val/score"] = 0.5
        tracker.log(metrics, step)
        assert not any(isinstance(v, (Histogram, Table)) for v in metrics.values())  # media taken out
    tracker.close()


def test_wandb_offline_and_mlflow_write_the_same_scalars_as_tensorboard(tmp_path, monkeypatch):
    _need("wandb")
    _need("mlflow")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    run_dir = tmp_path / "run"
    tracker = Tracking(str(run_dir / "tensorboard"), backends=["console", "tensorboard", "wandb", "mlflow"],
                       project_name="my-project", experiment_name="my-exp", config={"actor": {"lr": 1e-6}})
    _log_all(tracker)

    tb = read.tensorboard(str(run_dir / "tensorboard"))
    expected = {(k, s): v for s, m in STEPS.items() for k, v in m.items()}
    expected[("val/score", 2)] = 0.5
    assert tb["scalars"] == pytest.approx(expected)
    assert ("critic/score/hist", 2) in tb["histograms"] and tb["histograms"][("critic/score/hist", 2)][0] == 4
    assert "1+1=" in tb["text"][("val/generations", 2)] and "2 \\| two<br>ok" in tb["text"][("val/generations", 2)]

    wb = read.wandb_offline(str(run_dir))
    assert wb["scalars"] == pytest.approx(tb["scalars"])
    assert wb["media"] == {("critic/score/hist", 2): "histogram", ("val/generations", 2): "table-file"}
    assert wb["run"] == {"project": "my-project", "name": "my-exp"}

    ml = read.mlflow_store("file:" + str(run_dir / "mlruns"))
    assert ml["scalars"] == pytest.approx({(mlflow_key(k), s): v for (k, s), v in tb["scalars"].items()})
    assert ("val/openai/gsm8k/pass_at_4", 1) in ml["scalars"]
    assert (ml["experiment"], ml["run_name"]) == ("my-project", "my-exp")
    assert ml["params"]["actor.lr"] == "1e-06"
    assert ml["artifacts"] == ["val/generations/step_000002.json"]


def test_log_freq_writes_every_kth_step_validation_steps_and_the_last_at_close(tmp_path):
    tracker = Tracking(str(tmp_path / "tb"), backends=["tensorboard"], log_freq=2)
    tracker.log({"a": 1.0, "val/score": 0.25}, 1)  # validation: always written
    tracker.log({"a": 2.0}, 2)
    tracker.log({"a": 3.0}, 3)  # skipped ...
    tracker.log({"a": 5.0}, 5)  # ... and so is this one, until close()
    tracker.close()
    assert read.tensorboard(str(tmp_path / "tb"))["scalars"] == {("a", 1): 1.0, ("val/score", 1): 0.25,
                                                                  ("a", 2): 2.0, ("a", 5): 5.0}


def test_disabled_tracker_writes_nothing_but_still_strips_media(tmp_path):
    tracker = Tracking(str(tmp_path / "tb"), backends=["tensorboard", "wandb"], enabled=False)
    m = {"a": 1.0, "h": Histogram([1.0])}
    tracker.log(m, 1)
    tracker.close()
    assert m == {"a": 1.0} and not (tmp_path / "tb").exists()


def test_unknown_backend_and_bad_log_freq_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"unknown backends \['neptune'\]"):
        Tracking(str(tmp_path), backends=["console", "neptune"])
    with pytest.raises(ValueError, match="log_freq=0"):
        Tracking(str(tmp_path), backends=["console"], log_freq=0)


def test_wandb_without_credentials_says_how_to_go_offline(tmp_path, monkeypatch):
    _need("wandb")
    for k in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    with pytest.raises(RuntimeError, match="WANDB_MODE=offline"):
        Tracking(str(tmp_path / "tb"), backends=["wandb"])


def test_config_check_names_a_missing_logger_package(monkeypatch):
    import importlib.util

    from rlhf.config import compose_config
    from rlhf.config.validate import config_problems

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    cfg = compose_config(["trainer.logger=[console,mlflow]"])
    problems = [p for p in config_problems(cfg, check_files=True) if "mlflow" in p]
    assert problems == ["trainer.logger includes mlflow but the mlflow package is not installed: pip install "
                        "'rlhf-megatron-sglang[mlflow]', or drop mlflow."]


def test_markdown_table_escapes_cells():
    assert markdown_table(["a", "b"], [["x|y", 0.123456]]) == "| a | b |\n|---|---|\n| x\\|y | 0.1235 |"


def test_logging_has_time_and_rank_and_does_not_break_the_progress_bar(monkeypatch):
    from tqdm import tqdm

    from rlhf.logging_setup import setup_logging

    monkeypatch.delenv("RLHF_LOG_LEVEL", raising=False)
    stream = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        setup_logging(rank=3, level="INFO", stream=stream)
        bar = tqdm(total=4, file=stream, desc="PPO", ascii=True)
        bar.update(1)
        logging.getLogger("rlhf.test").info("hello from the trainer")
        bar.update(1)
        bar.close()
        setup_logging(rank=1, stream=stream)  # ranks other than 0: WARNING
        assert root.level == logging.WARNING
        with pytest.raises(ValueError, match="RLHF_LOG_LEVEL"):
            setup_logging(rank=0, level="LOUD")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        logging.captureWarnings(False)
    lines = stream.getvalue().replace("\r", "\n").split("\n")
    (line,) = [x for x in lines if "hello from the trainer" in x]
    # a line of its own (tqdm.write cleared the bar first), with time, rank, level and logger
    assert line.endswith("[rank 3] INFO rlhf.test: hello from the trainer") and line[:4].isdigit(), line


def test_known_harmless_warnings_are_filtered_and_others_are_not(monkeypatch):
    from rlhf.logging_setup import KNOWN_HARMLESS_WARNINGS, filter_known_warnings

    monkeypatch.delenv("RLHF_SHOW_ALL_WARNINGS", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filter_known_warnings()
        for message, category, _module, _why in KNOWN_HARMLESS_WARNINGS:
            warnings.warn_explicit(message.replace("\\", ""), category, "x.py", 1, module="megatron.core.x")
        warnings.warn_explicit("Transformer Engine and Apex are not installed", UserWarning, "x.py", 1,
                               module="mypackage")  # the same text from elsewhere stays
        warnings.warn("something else", UserWarning)
    assert [str(w.message) for w in caught] == ["Transformer Engine and Apex are not installed", "something else"]
    assert logging.getLogger("torch.utils.cpp_extension").level == logging.ERROR
    assert os.environ.get("HF_DATASETS_DISABLE_PROGRESS_BARS") == "1"

"""Where `convert_checkpoint.py mcore-to-hf --ckpt` finds a trainer checkpoint's HF config and tokenizer
(rlhf.trainer.hf_source), and the exit code 2 when it cannot.  The conversion itself (TP2 trainer checkpoint ->
HF, logits equal to the trainer's export) is in tests/e2e/test_launch_tutorial.py (slow)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlhf.config import compose_config
from rlhf.config.objects import write_run_config
from rlhf.trainer.hf_source import checkpoint_hf_source

from tests.support.paths import ROOT


def _run_dir(tmp_path, model_path):
    run = tmp_path / "run"
    actor = run / "checkpoints" / "global_step_3" / "actor"
    actor.mkdir(parents=True)
    (actor / "metadata.json").write_text("{}")
    write_run_config(compose_config([f"trainer.default_local_dir={run}", f"model.path={model_path}"]))
    return run, str(actor.parent)


def _model_dir(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return str(path)


def test_local_and_tiny_models_of_the_run_config(tmp_path):
    model = _model_dir(tmp_path / "m")
    run, ckpt = _run_dir(tmp_path, model)
    assert (run / "config.yaml").is_file()
    src = checkpoint_hf_source(ckpt)
    assert (src.mcore_path, src.hf_dir, src.tokenizer_dir) == (os.path.join(ckpt, "actor"), model, model)

    run2, ckpt2 = _run_dir(tmp_path / "t", "tiny://quickstart")
    tiny = _model_dir(run2 / "tiny_model" / "tiny_quickstart_model")
    assert checkpoint_hf_source(ckpt2).hf_dir == tiny
    other = _model_dir(tmp_path / "other")
    assert checkpoint_hf_source(ckpt2, hf_config=other).hf_dir == other  # --hf-config wins


def test_what_is_missing_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no actor/ dist checkpoint"):
        checkpoint_hf_source(str(tmp_path))
    run, ckpt = _run_dir(tmp_path, str(tmp_path / "gone"))
    with pytest.raises(FileNotFoundError, match=r"model.path=.*gone.*pass --hf-config"):
        checkpoint_hf_source(ckpt)
    os.remove(run / "config.yaml")
    with pytest.raises(FileNotFoundError, match=r"config.yaml not found.*pass --hf-config"):
        checkpoint_hf_source(ckpt)
    r = subprocess.run([sys.executable, "scripts/convert_checkpoint.py", "mcore-to-hf", "--ckpt", ckpt, "--out",
                        str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "pass --hf-config" in r.stderr and not (tmp_path / "out").exists()

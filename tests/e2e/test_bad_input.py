"""Bad input ends `python -m rlhf.main` with a clear error naming the file / row / key, before any model or
engine is built and with nothing half-written: a model path that does not exist, a checkpoint
directory of another model, a reward file that raises on import, an empty dataset, a prompt column of
the wrong type, all prompts longer than data.max_prompt_length (a config error naming the limit that keeps them).  No SGLang engine starts in these runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.support.paths import ROOT

pytestmark = pytest.mark.slow  # each case starts python -m rlhf.main (torch + megatron imports)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from rlhf.quickstart.tiny import make_tiny_hf_model, make_tiny_tokenizer

    out = str(tmp_path_factory.mktemp("tiny") / "model")
    tok = make_tiny_tokenizer()
    return make_tiny_hf_model(out, hidden_size=64, num_layers=2, vocab_size=len(tok), tokenizer=tok)


def run(args, tmp_path, expect_rc):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "rlhf.main", "recipe=quickstart", f"trainer.default_local_dir={out}",
                           "trainer.progress_bar=false", *args], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"), timeout=600)
    assert proc.returncode == expect_rc, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stderr, out


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_model_path_that_does_not_exist(tmp_path):
    err, out = run(["model.path=/nonexistent/Qwen2-0.5B"], tmp_path, 2)
    assert "model.path='/nonexistent/Qwen2-0.5B'" in err
    assert not out.exists()


def test_checkpoint_of_another_model_is_refused_before_any_build(model, tmp_path):
    ckpt = tmp_path / "run" / "checkpoints"
    (ckpt / "global_step_3").mkdir(parents=True)
    other = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "num_hidden_layers": 24}
    torch.save({"step": 3, "model": other}, ckpt / "global_step_3" / "trainer_state.pt")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")
    err, out = run([f"model.path={model}"], tmp_path, 1)
    assert f"checkpoint '{ckpt}/global_step_3' was saved for another model (architectures: checkpoint " \
           "['Qwen2ForCausalLM'] vs model ['LlamaForCausalLM'], hidden_size: checkpoint 896 vs model 64" in err
    assert "trainer.resume_mode=disable" in err
    assert sorted(os.listdir(ckpt)) == ["global_step_3", "latest_checkpointed_iteration.txt"]
    assert not (out / "tensorboard").exists()  # nothing written for the failed start


def test_reward_file_raising_on_import(model, tmp_path):
    bad = tmp_path / "my_reward.py"
    bad.write_text("raise RuntimeError('reward server URL not set')\n")
    err, out = run([f"model.path={model}", f"reward.custom_reward_function.path={bad}"], tmp_path, 1)
    assert f"executing '{bad}' failed: RuntimeError: reward server URL not set" in err
    assert not (out / "tensorboard").exists()


@pytest.mark.parametrize("case", ["empty", "wrong_prompt_type", "all_too_long"])
def test_bad_dataset(model, tmp_path, case):
    rows = {"empty": [],
            "wrong_prompt_type": [{"prompt": "1+1=", "ground_truth": "2", "data_source": "gsm8k"},
                                  {"prompt": 12345, "ground_truth": "3", "data_source": "gsm8k"}],
            "all_too_long": [{"prompt": "word " * 400, "ground_truth": "1", "data_source": "gsm8k"}] * 3}[case]
    data = write_rows(tmp_path / "train.jsonl", rows)
    # every case is a config error (exit 2, no engine or model built): the preflight reads the rows as the dataset
    # builder does and names the bad one, or the limit that keeps the too-long prompts
    err, out = run([f"model.path={model}", f"data.train_files={data}", f"data.val_files={data}",
                    "data.max_prompt_length=64"], tmp_path, 2)
    expect = {"empty": f"{data}: the dataset has no rows; give a file or split with data",
              "wrong_prompt_type": f"{data}: row 1: prompt must be a string or a list of chat messages, got int",
              "all_too_long": f"data.max_prompt_length=64 keeps 0 of the 3 prompts of data.train_files='{data}' "
                              "(0%)"}[case]
    assert expect in err
    assert not (out / "tensorboard").exists() and not (out / "checkpoints").exists()

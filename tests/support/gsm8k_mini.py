"""A few GSM8K-format questions of our own (question / answer ending in "#### N"), written as the recipe's
train/test jsonl files: the GSM8K recipes' data path on CPU tests without the real data set."""
from __future__ import annotations

import json
from pathlib import Path

QUESTIONS = [("Tom has 3 apples and buys 4 more. How many apples does he have?", "3 + 4 = 7\n#### 7"),
             ("A box holds 6 pens. How many pens are in 2 boxes?", "6 * 2 = 12\n#### 12"),
             ("Sara reads 5 pages a day for 3 days. How many pages does she read?", "5 * 3 = 15\n#### 15"),
             ("There are 10 birds and 4 fly away. How many are left?", "10 - 4 = 6\n#### 6")]

#: overrides of a one-step gsm8k_ppo_tiny_cpu run with a checkpoint (every multi-node / cluster test)
ONE_STEP = ["model.warmup_steps=5", "trainer.total_training_steps=1", "trainer.save_freq=1", "trainer.test_freq=-1",
            "trainer.val_before_train=false", "trainer.progress_bar=false", "trainer.logger=[console]",
            "data.max_response_length=8"]


def write_gsm8k_mini(d: Path) -> Path:
    """``d/train.jsonl`` and ``d/test.jsonl`` (8 rows each); returns ``d``."""
    d.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        (d / f"{split}.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n"
                                                  for q, a in QUESTIONS * 2))
    return d


def data_overrides(d: Path) -> list[str]:
    return [f"data.train_files={d}/train.jsonl", f"data.val_files={d}/test.jsonl"]


def check_one_step_run(text: str, run: Path) -> None:
    """A finished one-step run: the step's actor loss logged, checkpoint 1 and the HF export written."""
    import re

    assert re.search(r"(^|rlhf.metrics: )step 1: .*actor/pg_loss:", text, re.M), text[-4000:]
    assert (run / "checkpoints" / "global_step_1").is_dir()
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert (run / "hf_export" / "config.json").is_file() and list((run / "hf_export").glob("*.safetensors"))

"""The quickstart's MATH-style (boxed) task: verl's MATH parquet layout (examples/data_preprocess/math_dataset.py)
read by the trainer's dataset, its worked solutions scored 1 by the MATH rule reward (math-verify) and the
warm-up's corrupted ones 0."""
from __future__ import annotations

import pandas as pd

from rlhf.quickstart.arithmetic import (BOXED_TASK, MATH_DATA_SOURCE, MATH_INSTRUCTION, make_arithmetic_dataset,
                                        quickstart_task_kwargs, write_math_parquet)
from rlhf.quickstart.sft import corrupt_answers
from rlhf.rewards.registry import call_reward_fn, get_reward_fn


def test_math_parquet_has_verls_layout_and_reads_as_math(tmp_path):
    from rlhf.data.rl_dataset import RLHFDataset
    from rlhf.quickstart.tokenizer import make_quickstart_tokenizer

    paths = write_math_parquet(tmp_path, n_train=6, n_test=2, seed=3)
    df = pd.read_parquet(paths["train"])
    assert list(df.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    row = df.iloc[0]
    content = row["prompt"][0]["content"]
    a, b = map(int, content.split("$")[1].split("+"))
    assert content == f"What is ${a}+{b}$? {MATH_INSTRUCTION}" and row["prompt"][0]["role"] == "user"
    assert row["data_source"] == MATH_DATA_SOURCE == "DigitalLearningGmbH/MATH-lighteval"
    assert dict(row["reward_model"]) == {"style": "rule", "ground_truth": str(a + b)}
    assert dict(row["extra_info"]) == {"split": "train", "index": 0}
    ds = RLHFDataset(str(paths["train"]), make_quickstart_tokenizer(), max_prompt_length=64)
    assert len(ds) == 6 and ds[0]["ground_truth"] == str(a + b) and ds[0]["data_source"] == MATH_DATA_SOURCE


def test_boxed_solutions_score_by_the_math_reward_and_corrupted_ones_do_not():
    rows = make_arithmetic_dataset(40, seed=1, **quickstart_task_kwargs(9, BOXED_TASK))
    fn = get_reward_fn(MATH_DATA_SOURCE)

    def score(r, text):
        return call_reward_fn(fn, data_source=MATH_DATA_SOURCE, solution_str=text, ground_truth=r["ground_truth"])

    r = rows[0]
    a, b = r["extra_info"]["a"], r["extra_info"]["b"]
    assert r["solution"] == f"{a}+{b}={a + b}\nThe answer is \\boxed{{{a + b}}}."
    assert all(score(r, r["solution"]) == 1.0 for r in rows)
    bad = corrupt_answers(rows, 0.5, seed=0)
    changed = [(r, c) for r, c in zip(rows, bad) if c["solution"] != r["solution"]]
    assert 10 <= len(changed) <= 30
    for r, c in changed:  # only the boxed answer is changed: the worked line stays right
        assert c["solution"].split("\n")[0] == r["solution"].split("\n")[0] and score(r, c["solution"]) == 0.0

"""verl's multi-turn GSM8K rows (examples/data_preprocess/gsm8k_multiturn_w_tool.py) from raw GSM8K jsonl:
verl's system prompt (use calc_gsm8k_reward before answering), the question plus verl's instruction, and
``extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth`` / ``interaction_kwargs``.

    python recipes/gsm8k_multiturn_qwen2_5_3b/prepare_data.py [--src ../shared/data/gsm8k] [--out data/gsm8k_multiturn]

writes ``OUT/train.jsonl`` and ``OUT/test.jsonl`` (one row a line, as the trainer reads verl's parquet rows).
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

SYSTEM = ("You are a math expert. You are given a question and you need to solve it step by step. "
          "Reasoning step by step before any tool call. "
          "You should use the `calc_gsm8k_reward` tool after step by step solving the question, "
          "before generate final answer at least once and refine your answer if necessary. "
          "Put your final answer in the format of `#### <answer>`.")
INSTRUCTION = "Let's think step by step and output the final answer after `####`."


def extract_solution(answer: str) -> str:
    """verl's extract_solution: the number after ``#### ``, commas removed.  Raises ValueError without one."""
    m = re.search("#### (\\-?[0-9\\.\\,]+)", answer)
    if m is None:
        raise ValueError(f"GSM8K answer has no '#### <number>': ...{answer[-80:]!r}")
    return m.group(0).split("#### ")[1].replace(",", "")


def multiturn_row(question: str, answer: str, split: str, index: int) -> dict:
    """verl's row of one raw GSM8K record (its process_fn, field for field)."""
    solution = extract_solution(answer)
    full = question + " " + INSTRUCTION
    return {"data_source": "openai/gsm8k",
            "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": full}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": solution},
            "extra_info": {"split": split, "index": index, "answer": answer, "question": question,
                           "need_tools_kwargs": True,
                           "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": solution}}},
                           "interaction_kwargs": {"query": full, "ground_truth": solution}}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", default=str(Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "gsm8k"),
                   help="folder of raw GSM8K train.jsonl / test.jsonl (question, answer)")
    p.add_argument("--out", default="data/gsm8k_multiturn", help="output folder")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        src = Path(args.src) / f"{split}.jsonl"
        if not src.is_file():
            p.error(f"{src} not found: give --src a folder with GSM8K's train.jsonl and test.jsonl")
        with src.open() as f, (out / f"{split}.jsonl").open("w") as g:
            for i, line in enumerate(x for x in f if x.strip()):
                r = json.loads(line)
                g.write(json.dumps(multiturn_row(r["question"], r["answer"], split, i)) + "\n")
        print(f"{out / f'{split}.jsonl'}: {i + 1} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

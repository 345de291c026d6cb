#!/usr/bin/env python
"""Preprocess GSM8K into RL parquet files.

Examples::

    # from the shared local copy (no network):
    python scripts/preprocess_gsm8k.py --out data/gsm8k --local-path ../shared/data/gsm8k
    # from the HF hub:
    python scripts/preprocess_gsm8k.py --out data/gsm8k --source openai/gsm8k

Writes ``OUT/train.parquet`` and ``OUT/test.parquet`` (schema: rlhf/data/gsm8k.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhf.data.gsm8k import DATA_SOURCE, preprocess_gsm8k  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory for train.parquet / test.parquet")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--source", default=DATA_SOURCE, help="HF hub dataset id (default: %(default)s)")
    src.add_argument("--local-path", default=None, help="directory with raw train.jsonl and test.jsonl")
    p.add_argument("--flat-prompt", action="store_true", help="store prompt as a plain string, not chat messages")
    p.add_argument("--max-samples", type=int, default=None, help="keep only the first N problems per split")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    paths = preprocess_gsm8k(
        args.out, source=args.source, local_path=args.local_path, flat_prompt=args.flat_prompt,
        max_samples=args.max_samples,
    )
    for split, path in paths.items():
        print(f"{split}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

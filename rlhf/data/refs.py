"""What a data or model reference in the config points at, read without network and without torch.

Data (``data.train_files`` / ``data.val_files``, a string or a list of them)::

    /data/gsm8k/train.parquet   ./data/train.jsonl   data/dir/     a local file (parquet, jsonl, json) or directory
    openai/gsm8k                a hub dataset: datasets.load_dataset("openai/gsm8k")
    openai/gsm8k:main           ... with its config name: load_dataset("openai/gsm8k", "main")
    openai/gsm8k:main@test      ... and split: load_dataset("openai/gsm8k", "main", split="test")
    openai/gsm8k@train[:1000]   a split with a slice, as datasets writes it
    embedded://arithmetic       the generated task;  object://dataset/<id>: an in-process Dataset (rlhf.Trainer)

A path that exists locally is local; a string that looks like a path (absolute, ``./``, ``../``, ``~``, or a
data file extension) is local and must exist; otherwise ``OWNER/NAME[:CONFIG][@SPLIT]`` is a hub dataset.
Without ``@SPLIT`` the train files use split ``train`` and the validation files ``test`` (else ``validation``).

Models (``model.path``, ``model.critic_path``, ``model.tokenizer_path``, model reward sources): a local HF
directory (with config.json), a hub name ``OWNER/NAME`` (checked only when its config.json is already in the
local HF cache), ``tiny://quickstart``, or for the tokenizer ``object://tokenizer/<id>``.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

__all__ = ["DataRef", "ModelRef", "parse_data_ref", "parse_model_ref", "DATA_EXTENSIONS", "DEFAULT_SPLITS",
           "cached_hub_file"]

#: file extensions read as local data
DATA_EXTENSIONS = (".parquet", ".jsonl", ".json")
#: split used when a hub dataset reference names none: train files, validation files (first that exists)
DEFAULT_SPLITS = {"train": ("train",), "val": ("test", "validation")}
_HUB_DATA = re.compile(r"^(?P<name>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<config>[\w.-]+))?"
                       r"(?:@(?P<split>[\w.+%:\[\]-]+))?$")
_HUB_MODEL = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
#: tiny://quickstart: the warmed-up quickstart model; tiny://quickstart-init: the same model before its warm-up
#: (its initial weights; the on-policy distillation recipe's student); tiny://calc: warmed up on calculator tool calls
#: (rlhf.quickstart.calc; recipe calc_tool_tiny_cpu); tiny://quickstart-moe: the same on a tiny Qwen3-MoE (recipe
#: moe_r3_tiny_cpu)
TINY_MODELS = ("tiny://quickstart", "tiny://quickstart-init", "tiny://calc", "tiny://quickstart-moe")


@dataclass(frozen=True)
class DataRef:
    """kind: ``local`` (path: the file or directory; exists: whether it does), ``hub`` (path: the dataset
    name, config / split or None), ``embedded``, ``object`` (path: the URI), or ``invalid`` (why: the reason)."""

    kind: str
    path: str
    config: Optional[str] = None
    split: Optional[str] = None
    exists: bool = False
    why: str = ""


@dataclass(frozen=True)
class ModelRef:
    """kind: ``local`` (path: the directory), ``hub`` (path: the repo id), ``tiny``, ``object``, or ``invalid``."""

    kind: str
    path: str
    exists: bool = False
    why: str = ""


def _looks_local(s: str) -> bool:
    return (os.path.isabs(s) or s.startswith(("./", "../", "~", ".\\")) or s in (".", "..")
            or s.lower().endswith(DATA_EXTENSIONS))


def parse_data_ref(ref: str) -> DataRef:
    """Classify one data reference (see the module docstring); reads the filesystem, never the network."""
    s = str(ref).strip()
    if s.startswith("embedded://"):
        return DataRef("embedded", s, exists=True)
    if s.startswith("object://"):
        return DataRef("object", s)
    if "://" in s:
        return DataRef("invalid", s, why="unknown scheme; use a local path, a hub dataset OWNER/NAME or embedded://")
    local = os.path.expanduser(s)
    if os.path.exists(local):
        return DataRef("local", local, exists=True)
    if _looks_local(s):
        return DataRef("local", local, exists=False, why="no such file or directory")
    m = _HUB_DATA.match(s)
    if m:
        return DataRef("hub", m.group("name"), m.group("config"), m.group("split"))
    return DataRef("invalid", s, why="not a local file or directory, and not a hub dataset OWNER/NAME[:CONFIG][@SPLIT]")


def parse_model_ref(ref: str) -> ModelRef:
    """Classify one model reference; reads the filesystem, never the network."""
    s = str(ref).strip()
    if s.startswith("tiny://"):
        return ModelRef("tiny", s, exists=s.rstrip("/") in TINY_MODELS,
                        why="" if s.rstrip("/") in TINY_MODELS else f"the tiny models are {', '.join(TINY_MODELS)}")
    if s.startswith("object://"):
        return ModelRef("object", s)
    if "://" in s:
        return ModelRef("invalid", s,
                        why="unknown scheme; use an HF directory, a hub name OWNER/NAME or tiny://quickstart")
    local = os.path.expanduser(s)
    if os.path.exists(local):
        return ModelRef("local", local, exists=True)
    if _looks_local(s) or not _HUB_MODEL.match(s):
        return ModelRef("local", local, why="no such directory (and not a hub name OWNER/NAME)")
    return ModelRef("hub", s)


def cached_hub_file(repo_id: str, filename: str = "config.json", repo_type: Optional[str] = None) -> Optional[Path]:
    """The file of a hub repo when it is in the local HF cache (no network), else None."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers / datasets
        return None
    try:
        found = try_to_load_from_cache(repo_id, filename, repo_type=repo_type)
    except Exception:  # noqa: BLE001 - a malformed id is reported by the caller's own rules
        return None
    return Path(found) if isinstance(found, str) else None

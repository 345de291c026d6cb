"""What converting a trainer checkpoint to Hugging Face needs besides its weights: the model's HF config and
tokenizer, found from the run directory.

    <run>/config.yaml                          the run's composed config (written at start by rlhf.main /
                                               rlhf.Trainer.run: rlhf.config.objects)
    <run>/checkpoints/global_step_<k>/actor/   the actor's weights (dist_checkpointing, any TP/PP layout)

``scripts/convert_checkpoint.py mcore-to-hf --ckpt <run>/checkpoints/global_step_<k>`` calls
:func:`checkpoint_hf_source`: the config.json comes from ``model.path`` of the run's config (a local directory, a
hub name already in the local HF cache, or ``tiny://quickstart``: the model the run built under
``<run>/tiny_model``), the tokenizer from ``model.tokenizer_path`` (default: the model's); ``--hf-config DIR``
overrides both (a run from before config.yaml existed, or a model that moved).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from rlhf.config.objects import RUN_CONFIG

__all__ = ["CheckpointSource", "checkpoint_hf_source"]

@dataclass(frozen=True)
class CheckpointSource:
    """mcore_path: the role's dist checkpoint; hf_dir: a directory with the model's config.json; tokenizer_dir:
    where to load the tokenizer from (None: none found)."""

    mcore_path: str
    hf_dir: str
    tokenizer_dir: Optional[str]


def _local_model_dir(ref: str, run_dir: str) -> Optional[str]:
    from rlhf.data.refs import cached_hub_file, parse_model_ref

    if ref.startswith("tiny://"):
        path = os.path.join(run_dir, "tiny_model",
                            "tiny_calc_model" if ref.rstrip("/") == "tiny://calc" else "tiny_quickstart_model")
        return path if os.path.isfile(os.path.join(path, "config.json")) else None
    parsed = parse_model_ref(ref)
    if parsed.kind == "local":
        return parsed.path if os.path.isfile(os.path.join(parsed.path, "config.json")) else None
    if parsed.kind == "hub":
        found = cached_hub_file(parsed.path)
        return str(found.parent) if found else None
    return None


def checkpoint_hf_source(ckpt: str, hf_config: Optional[str] = None, role: str = "actor") -> CheckpointSource:
    """The pieces to convert trainer checkpoint `ckpt` (``<run>/checkpoints/global_step_<k>``) to HF.

    Raises:
        FileNotFoundError: `ckpt` has no `role` checkpoint, or no HF config can be found (the message says
            to pass ``--hf-config``).
    """
    ckpt = os.path.abspath(os.path.expanduser(ckpt))
    mcore_path = os.path.join(ckpt, role)
    if not os.path.isfile(os.path.join(mcore_path, "metadata.json")):
        raise FileNotFoundError(f"{ckpt} has no {role}/ dist checkpoint; give a trainer checkpoint directory "
                                f"<run>/checkpoints/global_step_<k>")
    if hf_config:
        hf_dir = _local_model_dir(hf_config, os.getcwd()) or hf_config
        if not os.path.isfile(os.path.join(hf_dir, "config.json")):
            raise FileNotFoundError(f"--hf-config {hf_config}: no config.json there (a local HF directory, or a hub "
                                    f"name already in the local HF cache)")
        return CheckpointSource(mcore_path, hf_dir, hf_dir)
    run_dir = os.path.dirname(os.path.dirname(ckpt))
    run_cfg = os.path.join(run_dir, RUN_CONFIG)
    hint = "; pass --hf-config <the HF model directory the run started from>"
    if not os.path.isfile(run_cfg):
        raise FileNotFoundError(f"{run_cfg} not found: cannot tell which model {ckpt} was trained from{hint}")
    from omegaconf import OmegaConf

    model = OmegaConf.load(run_cfg).model
    hf_dir = _local_model_dir(str(model.path), run_dir)
    if hf_dir is None:
        raise FileNotFoundError(f"model.path={model.path!r} of {run_cfg} is not a local HF directory (nor a hub model "
                                f"in the local HF cache){hint}")
    tok = model.get("tokenizer_path")
    tok_dir = _local_model_dir(str(tok), run_dir) if tok and not str(tok).startswith("object://") else hf_dir
    return CheckpointSource(mcore_path, hf_dir, tok_dir)

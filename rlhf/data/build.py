"""The trainer's prompt datasets from the config's ``data`` section, tokenised once per job.

    train = build_rl_dataset(cfg.data, "train", files, tokenizer, cache_dir, require_ground_truth=True)  # collective

Global rank 0 reads and tokenises (rlhf.data.rl_dataset.RLHFDataset) and writes the result to
``<cache_dir>/<split>_prompts.pkl`` (atomically: a temporary file renamed); the other ranks wait, then read that
file.  A problem found by rank 0 (empty data, a row without a ground truth, a prompt of the wrong type, every
prompt too long) is raised on every rank with the same message, and nothing is left written.  A single process
skips the file.

Config keys: ``prompt_key``, ``max_prompt_length``, ``max_train_samples`` / ``max_val_samples``,
``filter_overlong_prompts`` (drop prompts longer than max_prompt_length) else ``truncation`` (error | left |
right | middle), ``apply_chat_template`` (null: iff the tokenizer has a template), ``chat_template_kwargs``.
"""
from __future__ import annotations

import os
import pickle
from typing import Any, Callable

from .rl_dataset import RLHFDataset

__all__ = ["build_rl_dataset", "overlong_policy", "needs_ground_truth", "build_on_rank0"]


def overlong_policy(data_cfg: Any) -> str:
    """RLHFDataset's ``overlong`` from ``data.filter_overlong_prompts`` / ``data.truncation``."""
    if data_cfg.filter_overlong_prompts:
        return "filter"
    return "error" if str(data_cfg.truncation) == "error" else f"truncate_{data_cfg.truncation}"


def needs_ground_truth(reward_cfg: Any) -> bool:
    """True when a rule reward scores the samples (``reward.sources`` has a ``rule`` entry, or is empty with
    no ``custom_reward_function``): every prompt then needs a ground truth."""
    sources = list(reward_cfg.sources or [])
    if not sources:
        return not reward_cfg.custom_reward_function.path
    return any(s.type == "rule" for s in sources)


def build_on_rank0(build: Callable[[], Any], path: str | None) -> Any:
    """Collective. `build()` on global rank 0, its result pickled to `path` (tmp file + rename) and read back by
    the other ranks; an exception on rank 0 is re-raised on every rank (same type when it takes a message, else
    RuntimeError).  Without torch.distributed, a single process, or `path` None: just `build()`."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 or path is None:
        return build()
    result, status, error = None, [None], None
    if dist.get_rank() == 0:
        try:
            result = build()
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "wb") as f:
                pickle.dump(result, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, path)
        except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
            message = e.args[0] if len(e.args) == 1 and isinstance(e.args[0], str) else str(e)
            status, error = [(type(e), message)], e
    dist.broadcast_object_list(status, src=0)
    if error is not None:
        raise error  # rank 0: the original, with its traceback
    if status[0] is not None:
        kind, message = status[0]
        try:
            error = kind(message)
        except Exception:  # noqa: BLE001 - an exception type that does not take one message
            error = RuntimeError(f"{kind.__name__}: {message}")
        raise error
    if dist.get_rank() != 0:
        with open(path, "rb") as f:
            result = pickle.load(f)
    return result


def build_rl_dataset(data_cfg: Any, split: str, files: Any, tokenizer: Any, cache_dir: str | None,
                     require_ground_truth: bool = False) -> RLHFDataset:
    """Collective. The prompts of `split` ("train" or "val") from `files` (the resolved ``data.train_files`` /
    ``val_files``) with the ``data`` settings (module docstring), built by rank 0 (:func:`build_on_rank0`).

    Raises:
        ValueError / KeyError / TypeError: see :class:`RLHFDataset` (on every rank).
    """
    max_samples = data_cfg.max_train_samples if split == "train" else data_cfg.max_val_samples
    kwargs = data_cfg.chat_template_kwargs
    if kwargs is not None and not isinstance(kwargs, dict):
        from omegaconf import OmegaConf

        kwargs = OmegaConf.to_container(kwargs, resolve=True)

    def build() -> RLHFDataset:
        return RLHFDataset(_plain(files), tokenizer, data_cfg.max_prompt_length, prompt_key=data_cfg.prompt_key,
                           max_samples=max_samples, overlong=overlong_policy(data_cfg),
                           use_chat_template=data_cfg.apply_chat_template, chat_template_kwargs=kwargs or None,
                           require_ground_truth=require_ground_truth, split=split,
                           label_by_source=not require_ground_truth)

    path = os.path.join(cache_dir, f"{split}_prompts.pkl") if cache_dir else None
    dataset = build_on_rank0(build, path)
    dataset.tokenizer = tokenizer
    return dataset


def _plain(files: Any) -> Any:
    """A reference or a list of them as plain strings (OmegaConf lists included)."""
    if isinstance(files, (str, os.PathLike)):
        return os.fspath(files)
    return [os.fspath(f) if isinstance(f, os.PathLike) else str(f) for f in files]

"""Python API: build the same config the recipes use and train in this process.

    from rlhf import Trainer
    Trainer(algorithm="grpo", actor_model="tiny://quickstart", dataset="embedded://arithmetic",
            output_dir="outputs/api_grpo", recipe="quickstart").run()

Keyword arguments become config overrides (see docs/api.md): the named ones map to config keys
(`actor_model` -> model.path, `output_dir` -> trainer.default_local_dir, ...), `algorithm` picks a
preset (``algorithm=NAME``: ``rlhf/config/algorithm/<NAME>.yaml``, :data:`ALGORITHMS`), and any other
keyword is a config key: dotted (``**{"actor.optim.lr": 1e-5}``), with double underscores
(``actor__optim__lr=1e-5``) or a leaf name that occurs once in the schema (``total_training_steps=5``).
The config is composed and validated when the Trainer is created (a bad key raises
:class:`rlhf.config.ConfigError` at once).

`run()` trains in this process as one rank.  Several ranks: start the same script with torchrun
(``torchrun --nproc_per_node=8 train.py``); every rank builds the same config.  The ``rlhf launch``
command (rlhf/cli.py) does that for you.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Optional, Sequence

from rlhf.config.compose import list_algorithms
from rlhf.config.overrides import config_key, format_value

__all__ = ["Trainer", "ALGORITHMS", "build_overrides", "format_value"]

#: the algorithm presets (``rlhf/config/algorithm/<name>.yaml``), applied on top of the recipe
ALGORITHMS: tuple[str, ...] = tuple(list_algorithms())


def _reward_overrides(reward_model: Any) -> list[str]:
    if reward_model is None:
        return []
    if isinstance(reward_model, (list, tuple)):  # reward.sources entries
        return [f"reward.sources={format_value(list(reward_model))}"]
    ref = os.fspath(reward_model)
    path, _, fn = ref.partition(".py:")
    if ref.endswith(".py") or fn:  # a python reward function: file.py or file.py:function
        path = path if ref.endswith(".py") else path + ".py"
        return [f"reward.custom_reward_function.path={format_value(path)}"] + (
            [f"reward.custom_reward_function.name={format_value(fn)}"] if fn else [])
    return [f"reward.sources=[{{type:model,path:{format_value(ref)},weight:1.0}}]"]  # HF reward model


def build_overrides(algorithm: Optional[str] = None, actor_model: Any = None, critic_model: Any = None,
                    reward_model: Any = None, dataset: Any = None, val_dataset: Any = None,
                    output_dir: Any = None, overrides: Sequence[str] = (), **kwargs: Any) -> list[str]:
    """The override list `Trainer` composes (``algorithm=NAME`` first, then the named arguments,
    `overrides` strings, then keyword config keys).  `dataset` also serves as validation set
    unless `val_dataset` is given.  `reward_model`: an HF reward-model directory / hub name
    (a model reward source), ``file.py`` or ``file.py:function`` (custom reward function), or a
    list of reward.sources dicts.

    Raises:
        ValueError: an unknown algorithm, or a critic with a critic-free algorithm.
        TypeError: an unknown or ambiguous keyword (:func:`rlhf.config.overrides.config_key`).
    """
    out: list[str] = []
    if algorithm is not None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"Trainer: unknown algorithm {algorithm!r}; use one of {sorted(ALGORITHMS)}")
        out.append(f"algorithm={algorithm}")
    if critic_model is not None:
        if algorithm not in (None, "ppo"):
            raise ValueError(f"Trainer: critic_model is only used by algorithm='ppo' (GAE), not {algorithm!r}")
        out += [f"model.critic_path={format_value(critic_model)}", "critic.enable=true"]
    if actor_model is not None:
        out.append(f"model.path={format_value(actor_model)}")
    if dataset is not None:
        out.append(f"data.train_files={format_value(dataset)}")
        out.append(f"data.val_files={format_value(val_dataset if val_dataset is not None else dataset)}")
    elif val_dataset is not None:
        out.append(f"data.val_files={format_value(val_dataset)}")
    if output_dir is not None:
        out.append(f"trainer.default_local_dir={format_value(output_dir)}")
    out += _reward_overrides(reward_model)
    out += [str(o) for o in overrides]
    out += [f"{config_key(k)}={format_value(v)}" for k, v in kwargs.items()]
    return out


class Trainer:
    """Compose (and validate) the config now; `run()` trains.  See the module docstring.

    `algorithm` (one of :data:`ALGORITHMS`) applies its preset on top of the recipe; None keeps
    the recipe's (or the base config's PPO with GAE).

    Attributes:
        overrides: the override strings (same syntax as ``python -m rlhf.main``).
        recipe: the recipe name or None.
        config: the composed DictConfig.
    """

    def __init__(self, algorithm: Optional[str] = None, actor_model: Any = None, critic_model: Any = None,
                 reward_model: Any = None, dataset: Any = None, val_dataset: Any = None, output_dir: Any = None,
                 recipe: Optional[str] = None, overrides: Sequence[str] = (), **kwargs: Any):
        from rlhf.config import compose_config, validate_config
        from rlhf.launch_env import launch_env

        self.recipe = recipe
        self.overrides = build_overrides(algorithm, actor_model, critic_model, reward_model, dataset, val_dataset,
                                         output_dir, overrides, **kwargs)
        self.config = compose_config(self.overrides, recipe=recipe)
        validate_config(self.config, world_size=launch_env().world_size)

    def command(self, nproc: int = 1) -> list[str]:
        """The equivalent torchrun command line (argv list)."""
        return ["torchrun", "--standalone", "--nnodes=1", f"--nproc_per_node={nproc}", "-m", "rlhf.main",
                *([f"recipe={self.recipe}"] if self.recipe else []), *self.overrides]

    def run(self) -> dict:
        """Train (in this process; one rank of a torchrun job when started by torchrun).
        Returns the last step's metrics."""
        from rlhf.trainer import run

        _start_checkpoint_writer()
        return run(self.config)


def _start_checkpoint_writer() -> None:
    """megatron's checkpoint writer starts a multiprocessing 'spawn' helper at the first save; a
    spawn child re-runs the caller's script unless it is guarded by ``if __name__ == "__main__":``.
    Start that helper now with the script path hidden, so an unguarded script works as written."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or getattr(getattr(main, "__spec__", None), "name", None):
        return  # interactive, or `python -m module`: nothing is re-run
    try:
        from megatron.core.dist_checkpointing.strategies.filesystem_async import _get_write_results_queue
    except ImportError:
        return
    del main.__file__
    try:
        _get_write_results_queue()
    finally:
        main.__file__ = path

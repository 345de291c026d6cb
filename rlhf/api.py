"""Python API: build the same config the recipes use and train in this process.

    from rlhf import Trainer
    Trainer(algorithm="grpo", actor_model="tiny://quickstart", dataset="embedded://arithmetic",
            output_dir="outputs/api_grpo", recipe="quickstart").run()

Keyword arguments become config overrides (see docs/api.md): the named ones map to config keys
(`actor_model` -> model.path, `output_dir` -> trainer.default_local_dir, ...), `algorithm` picks a
preset (:data:`ALGORITHMS`), and any other keyword is a config key: dotted
(``**{"actor.optim.lr": 1e-5}``), with double underscores (``actor__optim__lr=1e-5``) or a leaf name
that occurs once in the schema (``total_training_steps=5``).  The config is composed and validated
when the Trainer is created (a bad key raises :class:`rlhf.config.ConfigError` at once).

`run()` trains in this process as one rank.  Several ranks: start the same script with torchrun
(``torchrun --nproc_per_node=8 train.py``); every rank builds the same config.  The ``rlhf launch``
command (rlhf/cli.py) does that for you.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Any, Optional, Sequence

__all__ = ["Trainer", "ALGORITHMS", "build_overrides", "format_value"]

_GRPO = ["algorithm.name=ppo", "algorithm.adv_estimator=grpo", "critic.enable=null"]
#: algorithm name -> config overrides applied before the caller's (after the recipe)
ALGORITHMS: dict[str, list[str]] = {
    "ppo": ["algorithm.name=ppo", "algorithm.adv_estimator=gae"],
    "grpo": _GRPO,
    "dr_grpo": _GRPO + ["algorithm.norm_adv_by_std_in_grpo=false", "actor.loss_agg_mode=seq-mean-token-sum-norm"],
    "rloo": ["algorithm.name=ppo", "algorithm.adv_estimator=rloo", "critic.enable=null"],
    "reinforce_plus_plus": ["algorithm.name=ppo", "algorithm.adv_estimator=reinforce_plus_plus", "critic.enable=null"],
    "reinforce_plus_plus_baseline": ["algorithm.name=ppo", "algorithm.adv_estimator=reinforce_plus_plus_baseline",
                                     "critic.enable=null"],
    "dapo": _GRPO + ["algorithm.filter_groups.enable=true", "actor.clip_ratio_low=0.2", "actor.clip_ratio_high=0.28",
                     "actor.loss_agg_mode=token-mean", "reward.overlong_buffer.enable=true"],
    "dpo": ["algorithm.name=dpo"],
}
#: presets that need several responses per prompt: rollout.n=4 unless the recipe or caller sets n >= 2
GROUP_ALGORITHMS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "dapo")
DEFAULT_GROUP_N = 4


def format_value(v: Any) -> str:
    """A Python value as a Hydra override value (strings quoted, so any path is taken literally)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(format_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{format_value(x)}" for k, x in v.items()) + "}"
    s = os.fspath(v) if isinstance(v, os.PathLike) else str(v)
    if re.fullmatch(r"[A-Za-z0-9_./:@+-]+", s) and _parses_as(s, s):
        return s  # plain token (paths, hub names): no quotes, shell friendly
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _parses_as(raw: str, expected: str) -> bool:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides([f"k={raw}"])[0].value() == expected
    except Exception:  # noqa: BLE001
        return False


def _schema_paths() -> list[str]:
    from omegaconf import DictConfig, OmegaConf

    from rlhf.config.schema import RLHFConfig

    def walk(node, prefix):
        for k in node.keys():
            yield prefix + k
            child = node._get_node(k)
            if isinstance(child, DictConfig):
                yield from walk(child, prefix + k + ".")

    return list(walk(OmegaConf.structured(RLHFConfig), ""))


def _config_key(name: str) -> str:
    """Dotted config key for a keyword name (dotted, double-underscore, or a unique leaf name)."""
    from rlhf.config.loader import nearest_keys

    key = name.replace("__", ".")
    paths = _schema_paths()
    if "." in key or key in paths:
        return key  # checked (with suggestions) when the config is composed
    found = [p for p in paths if p.rsplit(".", 1)[-1] == key]
    if len(found) == 1:
        return found[0]
    if found:
        raise TypeError(f"Trainer: keyword {name!r} is ambiguous; use one of {found} "
                        f"(e.g. **{{{found[0]!r}: ...}} or {found[0].replace('.', '__')}=...)")
    near = nearest_keys(key)
    raise TypeError(f"Trainer: unknown keyword {name!r}" + (f"; did you mean {near}?" if near else ""))


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
    """The override list `Trainer` composes (algorithm preset first, then the named arguments,
    `overrides` strings, then keyword config keys).  `dataset` also serves as validation set
    unless `val_dataset` is given.  `reward_model`: an HF reward-model directory / hub name
    (a model reward source), ``file.py`` or ``file.py:function`` (custom reward function), or a
    list of reward.sources dicts.

    Raises ValueError for an unknown algorithm or a critic with a critic-free algorithm."""
    out: list[str] = []
    if algorithm is not None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"Trainer: unknown algorithm {algorithm!r}; use one of {sorted(ALGORITHMS)}")
        out += ALGORITHMS[algorithm]
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
    out += [f"{_config_key(k)}={format_value(v)}" for k, v in kwargs.items()]
    return out


def _sets(overrides: Sequence[str], key: str) -> bool:
    return any(o.split("=", 1)[0].lstrip("+~") == key for o in overrides)


class Trainer:
    """Compose (and validate) the config now; `run()` trains.  See the module docstring.

    `algorithm` (a key of :data:`ALGORITHMS`) applies its preset on top of the recipe; None keeps
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
        from rlhf.main import _launch_world_size

        self.recipe = recipe
        self.overrides = build_overrides(algorithm, actor_model, critic_model, reward_model, dataset, val_dataset,
                                         output_dir, overrides, **kwargs)
        cfg = compose_config(self.overrides, recipe=recipe)
        if algorithm in GROUP_ALGORITHMS and cfg.rollout.n < 2 and not _sets(self.overrides, "rollout.n"):
            self.overrides.append(f"rollout.n={DEFAULT_GROUP_N}")
            cfg = compose_config(self.overrides, recipe=recipe)
        validate_config(cfg, world_size=_launch_world_size())
        self.config = cfg

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

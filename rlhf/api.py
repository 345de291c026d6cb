"""Python API: build the same config the recipes use and train in this process.

    from rlhf import Trainer
    Trainer(algorithm="grpo", actor_model="tiny://quickstart", dataset="embedded://arithmetic",
            output_dir="outputs/api_grpo", recipe="quickstart").run()

Keyword arguments become config overrides (see docs/api.md): the named ones map to config keys
(`actor_model` -> model.path, `output_dir` -> trainer.default_local_dir, ...), `algorithm` picks a
preset (``algorithm=NAME``: ``rlhf/config/algorithm/<NAME>.yaml``, :data:`ALGORITHMS`), and any other
keyword is a config key: dotted (``**{"actor.optim.lr": 1e-5}``), with double underscores
(``actor__optim__lr=1e-5``) or a leaf name that occurs once in the schema (``total_training_steps=5``):
:func:`config_key`.
The config is composed and validated when the Trainer is created (a bad key raises
:class:`rlhf.config.ConfigError` at once).

Objects that have no YAML form stay in this process: a reward function object (``reward_model=fn``,
``safety_reward_model=fn``), a ``datasets.Dataset`` / ``DatasetDict`` / list of row dicts (``dataset=``), a
tokenizer object (``tokenizer=``) are registered in :mod:`rlhf.config.objects` and the config holds their
``object://<kind>/<n>`` URIs, which the trainer's builders resolve in this process.

`run()` trains in this process as one rank.  Several ranks: start the same script with torchrun
(``torchrun --nproc_per_node=8 train.py``); every rank builds the same config.  The ``rlhf launch``
command (rlhf/cli.py) does that for you.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any, Optional, Sequence

from rlhf.config.compose import list_algorithms
from rlhf.config.keys import all_schema_paths, nearest_keys
from rlhf.config.objects import is_object_ref, register_object
from rlhf.config.objects import format_value

__all__ = ["Trainer", "ALGORITHMS", "build_overrides", "format_value"]

#: the algorithm presets (``rlhf/config/algorithm/<name>.yaml``), applied on top of the recipe
ALGORITHMS: tuple[str, ...] = tuple(list_algorithms())


def _is_dataset(obj: Any) -> bool:
    """A ``datasets.Dataset`` (or anything with columns and rows) or a list of row dicts, not a path."""
    if isinstance(obj, (list, tuple)):
        return bool(obj) and all(isinstance(r, Mapping) for r in obj)
    return hasattr(obj, "column_names") and hasattr(obj, "__getitem__")


def _data_ref(obj: Any) -> Any:
    """A path / hub name / embedded:// (or a list of them) as given; an in-process dataset as its object URI."""
    if obj is None or isinstance(obj, (str, os.PathLike)):
        return obj
    if _is_dataset(obj):
        return register_object(obj, "dataset")
    if isinstance(obj, (list, tuple)) and all(isinstance(x, (str, os.PathLike)) for x in obj):
        return list(obj)
    raise TypeError(f"Trainer: a dataset is a path, a hub name (openai/gsm8k), a list of them, a datasets.Dataset, "
                    f"a DatasetDict or a list of row dicts; got {type(obj).__name__}")


def _split_dataset_dict(dataset: Any, val_dataset: Any) -> tuple[Any, Any]:
    """A DatasetDict gives its ``train`` split, and ``test`` / ``validation`` as validation data."""
    if isinstance(dataset, Mapping) and "train" in dataset and _is_dataset(dataset["train"]):
        val = next((dataset[k] for k in ("test", "validation") if k in dataset), None)
        return dataset["train"], val_dataset if val_dataset is not None else val
    return dataset, val_dataset


def _model_ref(obj: Any, what: str) -> Optional[str]:
    """Any model reference the actor takes (HF directory, hub name, tiny://quickstart), as a string."""
    if obj is None or isinstance(obj, (str, os.PathLike)):
        return None if obj is None else os.fspath(obj)
    hint = "; save it with .save_pretrained(DIR) and pass DIR" if hasattr(obj, "save_pretrained") else ""
    raise TypeError(f"Trainer: {what} is an HF directory, a hub name or tiny://quickstart, not a "
                    f"{type(obj).__name__}{hint}")


def _reward_source(ref: Any, weight: float) -> dict:
    """One reward.sources entry: a callable (in-process), ``file.py[:function]``, or an HF reward model."""
    if hasattr(ref, "save_pretrained"):  # a model object (callable, but not a reward function)
        _model_ref(ref, "a reward model")
    if callable(ref) and not isinstance(ref, (str, os.PathLike)):
        return {"type": "custom", "path": register_object(ref, "reward"), "weight": weight}
    if isinstance(ref, Mapping):
        src = dict(ref)
        if callable(src.get("path")):
            src["path"] = register_object(src["path"], "reward")
        return src
    path = _model_ref(ref, "a reward model")
    file, _, fn = path.partition(".py:")
    if path.endswith(".py") or fn:
        return {"type": "custom", "path": file if path.endswith(".py") else file + ".py", "weight": weight,
                **({"name": fn} if fn else {})}
    return {"type": "model", "path": path, "weight": weight}


def _reward_overrides(reward_model: Any, safety_reward_model: Any = None,
                      safety_reward_weight: float = 1.0) -> list[str]:
    if reward_model is None and safety_reward_model is None:
        return []
    if isinstance(reward_model, (list, tuple)):  # reward.sources entries
        sources = [_reward_source(r, 1.0) for r in reward_model]
    elif reward_model is None:
        sources = [{"type": "rule", "weight": 1.0}]  # the rule reward of each data_source
    else:
        sources = [_reward_source(reward_model, 1.0)]
    if safety_reward_model is not None:
        sources.append(_reward_source(safety_reward_model, safety_reward_weight))
    elif len(sources) == 1 and sources[0]["type"] == "custom" and not is_object_ref(sources[0]["path"]):
        src = sources[0]  # one reward function file: the custom_reward_function keys, as the CLI writes them
        return [f"reward.custom_reward_function.path={format_value(src['path'])}"] + (
            [f"reward.custom_reward_function.name={format_value(src['name'])}"] if "name" in src else [])
    if len(sources) == 1 and sources[0]["type"] == "model" and isinstance(reward_model, (str, os.PathLike)):
        return [f"reward.sources=[{{type:model,path:{format_value(sources[0]['path'])},weight:1.0}}]"]
    return [f"reward.sources={format_value(sources)}"]


def config_key(name: str) -> str:
    """Dotted config key for a keyword name: dotted (``"actor.optim.lr"``), with double underscores
    (``actor__optim__lr``) or a leaf name that occurs once in the schema (``total_training_steps``).

    Raises:
        TypeError: an ambiguous leaf name (lists the candidates) or an unknown one (with suggestions).
    """
    key = name.replace("__", ".")
    paths = all_schema_paths()
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


def build_overrides(algorithm: Optional[str] = None, actor_model: Any = None, critic_model: Any = None,
                    reward_model: Any = None, dataset: Any = None, val_dataset: Any = None,
                    output_dir: Any = None, overrides: Sequence[str] = (), *, safety_reward_model: Any = None,
                    safety_reward_weight: float = 1.0, tokenizer: Any = None, **kwargs: Any) -> list[str]:
    """The override list `Trainer` composes (``algorithm=NAME`` first, then the named arguments,
    `overrides` strings, then keyword config keys).  `dataset` also serves as validation set
    unless `val_dataset` is given (a DatasetDict: its ``train`` split, and ``test`` / ``validation``).
    `reward_model`: an HF reward-model directory / hub name (a model reward source), ``file.py`` or
    ``file.py:function`` (custom reward function), a callable (an in-process custom reward), or a list of
    reward.sources dicts; `safety_reward_model` (same forms) is one more source weighted by
    `safety_reward_weight`.  In-process objects (callables, datasets, tokenizer objects) are registered in
    :mod:`rlhf.config.objects` and appear in the config as ``object://...``.

    Raises:
        ValueError: an unknown algorithm, or a critic with a critic-free algorithm.
        TypeError: an unknown or ambiguous keyword (:func:`config_key`), or an
            argument of a type that has no config form (e.g. a model object).
    """
    out: list[str] = []
    if algorithm is not None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"Trainer: unknown algorithm {algorithm!r}; use one of {sorted(ALGORITHMS)}")
        out.append(f"algorithm={algorithm}")
    if critic_model is not None:
        if algorithm not in (None, "ppo"):
            raise ValueError(f"Trainer: critic_model is only used by algorithm='ppo' (GAE), not {algorithm!r}")
        out += [f"model.critic_path={format_value(_model_ref(critic_model, 'critic_model'))}", "critic.enable=true"]
    if actor_model is not None:
        out.append(f"model.path={format_value(_model_ref(actor_model, 'actor_model'))}")
    if tokenizer is not None:
        tok = tokenizer if isinstance(tokenizer, (str, os.PathLike)) else register_object(tokenizer, "tokenizer")
        out.append(f"model.tokenizer_path={format_value(tok)}")
    dataset, val_dataset = _split_dataset_dict(dataset, val_dataset)
    train, val = _data_ref(dataset), _data_ref(val_dataset)
    if train is not None:
        out.append(f"data.train_files={format_value(train)}")
        out.append(f"data.val_files={format_value(val if val is not None else train)}")
    elif val is not None:
        out.append(f"data.val_files={format_value(val)}")
    if output_dir is not None:
        out.append(f"trainer.default_local_dir={format_value(output_dir)}")
    out += _reward_overrides(reward_model, safety_reward_model, safety_reward_weight)
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
                 recipe: Optional[str] = None, overrides: Sequence[str] = (), *, safety_reward_model: Any = None,
                 safety_reward_weight: float = 1.0, tokenizer: Any = None, config_file: Any = None, **kwargs: Any):
        from rlhf.config import compose_config, validate_config
        from rlhf.launch_env import launch_env

        self.recipe = recipe
        self.config_file = config_file
        self.overrides = build_overrides(algorithm, actor_model, critic_model, reward_model, dataset, val_dataset,
                                         output_dir, overrides, safety_reward_model=safety_reward_model,
                                         safety_reward_weight=safety_reward_weight, tokenizer=tokenizer, **kwargs)
        self.config = compose_config(self.overrides, recipe=recipe, config_file=config_file)
        validate_config(self.config, world_size=launch_env().world_size, check_files=True)

    def command(self, nproc: int = 1) -> list[str]:
        """The equivalent torchrun command line (argv list).

        Raises:
            ValueError: the config holds in-process objects (``object://``), which a new process cannot see.
        """
        objects = [o for o in self.overrides if "object://" in o]
        if objects:
            raise ValueError(f"Trainer.command: {objects} refer to objects of this Python process; run() here, or "
                             f"give paths (Dataset.to_parquet, tokenizer.save_pretrained, a reward .py file)")
        return ["torchrun", "--standalone", "--nnodes=1", f"--nproc_per_node={nproc}", "-m", "rlhf.main",
                *([f"--config={self.config_file}"] if self.config_file else []),
                *([f"recipe={self.recipe}"] if self.recipe else []), *self.overrides]

    def run(self) -> dict:
        """Train (in this process; one rank of a torchrun job when started by torchrun).
        Returns the last step's metrics."""
        from rlhf.launch_env import launch_env
        from rlhf.logging_setup import setup_logging
        from rlhf.trainer import run

        from rlhf.config.objects import write_run_config

        setup_logging(launch_env().rank, force=False)  # an application's own logging config is kept
        if launch_env().rank == 0:
            write_run_config(self.config)  # <output_dir>/config.yaml: what the run trained (checkpoint conversion)
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

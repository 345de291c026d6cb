"""Compose and validate the training config.

:func:`compose_config` builds the config with Hydra's compose API from the config tree inside the
``rlhf.config`` package (base ``ppo_trainer.yaml`` + an optional recipe + ``key=value`` overrides), so
it works from any working directory, in tests and under torchrun/Slurm (every rank composes the same
config).  Keys are checked against the structured schema (:mod:`rlhf.config.schema`): a misspelled or
removed key -- on the command line or in a recipe file -- raises :class:`ConfigKeyError` naming the
key, where it came from and the nearest valid keys.

:func:`validate_config` checks values that the schema's types cannot express (choices, divisibility of
batch sizes, settings that need each other) and raises :class:`ConfigValidationError` listing every
problem with its fix.
"""
from __future__ import annotations

import difflib
import functools
import os
import re
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

from omegaconf import DictConfig, ListConfig, OmegaConf

from rlhf.config import BASE_CONFIG_NAME, RECIPE_GROUP, register_configs

__all__ = [
    "ConfigError",
    "ConfigKeyError",
    "ConfigValidationError",
    "compose_config",
    "validate_config",
    "list_recipes",
    "schema_keys",
    "nearest_keys",
]

_CONFIG_MODULE = "rlhf.config"


# --------------------------------------------------------------------------- errors


class ConfigError(ValueError):
    """Any problem with the training config found at start-up (`rlhf.main` prints it and exits 2)."""


class ConfigKeyError(ConfigError):
    """A config key (or recipe name) that does not exist.

    Attributes:
        key: the full dotted key as given (``"trainer.totl_training_steps"``), or the recipe name.
        suggestions: nearest valid full keys (or recipe names), best first; may be empty.
        source: where the key came from (``"command-line override 'a.b=1'"``, ``"recipe/foo.yaml"``).
    """

    def __init__(self, message: str, key: str = "", suggestions: Sequence[str] = (), source: str = ""):
        super().__init__(message)
        self.key = key
        self.suggestions = list(suggestions)
        self.source = source


class ConfigValidationError(ConfigError):
    """One or more invalid values; ``problems`` lists each (value, why, fix) as one line."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"Invalid config ({len(self.problems)} problem{'s' * (len(self.problems) != 1)}):\n{lines}")


# --------------------------------------------------------------------------- schema keys


@functools.lru_cache(maxsize=1)
def _schema() -> DictConfig:
    from rlhf.config.schema import RLHFConfig

    return OmegaConf.structured(RLHFConfig)


def _schema_node(path: Sequence[str]) -> Optional[DictConfig]:
    """The schema's dict node at ``path`` (list of key parts), or None when it is not a dict node."""
    node: Any = _schema()
    for part in path:
        if not isinstance(node, DictConfig) or part not in node:
            return None
        node = node._get_node(part)
    return node if isinstance(node, DictConfig) else None


def schema_keys(prefix: str = "") -> list[str]:
    """Keys of the schema directly under ``prefix`` (``""`` = top level, ``"actor.optim"``), in order.

    Raises:
        ConfigKeyError: ``prefix`` is not a section of the schema.
    """
    parts = [p for p in prefix.split(".") if p]
    node = _schema_node(parts)
    if node is None:
        raise _unknown_key_error(prefix, source="schema_keys()")
    return [str(k) for k in node.keys()]


@functools.lru_cache(maxsize=1)
def _all_schema_paths() -> tuple[str, ...]:
    """Every full dotted key of the schema, sections and leaves."""
    out: list[str] = []

    def walk(node: DictConfig, prefix: str) -> None:
        for k in node.keys():
            full = f"{prefix}{k}"
            out.append(full)
            child = node._get_node(k)
            if isinstance(child, DictConfig):
                walk(child, full + ".")

    walk(_schema(), "")
    return tuple(out)


def _split_key(full_key: str) -> list[str]:
    """``"a.b[0].c"`` -> ``["a", "b", "c"]`` (list indices dropped)."""
    return [p for p in re.sub(r"\[[^\]]*\]", "", full_key).split(".") if p]


def _first_bad_part(parts: Sequence[str]) -> Optional[int]:
    """Index of the first key part that is not in the schema (None when the whole path is valid or
    leaves the schema's dict nodes, e.g. goes inside a list or an ``Any`` field)."""
    node: Any = _schema()
    for i, part in enumerate(parts):
        if not isinstance(node, DictConfig):
            return None
        if part not in node:
            return i
        node = node._get_node(part)
    return None


def nearest_keys(full_key: str, n: int = 3) -> list[str]:
    """Nearest valid full keys for an unknown ``full_key``: close names at the same level first
    (difflib), then keys elsewhere in the schema that end the same way (a key moved to another
    section, or verl's ``actor_rollout_ref.actor.clip_ratio`` for our ``actor.clip_ratio``)."""
    parts = _split_key(full_key)
    i = _first_bad_part(parts)
    if i is None:
        return []
    prefix, bad = parts[:i], parts[i]
    level = [str(k) for k in _schema_node(prefix).keys()]  # type: ignore[union-attr]
    pre = ".".join(prefix) + "." if prefix else ""
    out = [pre + m for m in difflib.get_close_matches(bad, level, n=n, cutoff=0.6)]
    paths = _all_schema_paths()
    tail = parts[i:]
    for k in range(len(tail), 0, -1):  # longest matching suffix first
        found = [p for p in paths if p.split(".")[-k:] == tail[-k:]]
        if found:
            out += found
            break
    if not out:  # a fuzzy leaf-name match anywhere
        leaf = {p.split(".")[-1]: [] for p in paths}
        for p in paths:
            leaf[p.split(".")[-1]].append(p)
        for m in difflib.get_close_matches(tail[-1], list(leaf), n=n, cutoff=0.75):
            out += leaf[m]
    seen: list[str] = []
    for p in out:
        if p not in seen:
            seen.append(p)
    return seen[:n]


def _unknown_key_error(full_key: str, source: str = "") -> ConfigKeyError:
    parts = _split_key(full_key)
    i = _first_bad_part(parts)
    if i is None:  # should not happen; keep a useful message anyway
        return ConfigKeyError(f"Unknown config key {full_key!r}" + (f" ({source})" if source else "") + ".",
                              key=full_key, source=source)
    prefix, bad = parts[:i], parts[i]
    where = f"section {'.'.join(prefix)!r}" if prefix else "the top level"
    level = [str(k) for k in _schema_node(prefix).keys()]  # type: ignore[union-attr]
    suggestions = nearest_keys(full_key)
    lines = [f"Unknown config key {full_key!r}" + (f" ({source})" if source else "") + "."]
    lines.append(f"{where[0].upper()}{where[1:]} has no key {bad!r}."
                 + (f" Did you mean: {', '.join(suggestions)}?" if suggestions else ""))
    lines.append((f"Valid keys in {'.'.join(prefix)!r}: " if prefix else "Valid top-level keys: ") + ", ".join(level))
    return ConfigKeyError("\n".join(lines), key=full_key, suggestions=suggestions, source=source)


def _check_closed(cfg: DictConfig, source: str = "composed config") -> None:
    """Every key of ``cfg`` must exist in the schema (catches ``+key=value`` additions and anything
    else Hydra let through)."""

    def walk(node: DictConfig, schema: DictConfig, prefix: str) -> None:
        for k in node.keys():
            full = f"{prefix}{k}"
            if k not in schema:
                raise _unknown_key_error(full, source)
            child, schild = node._get_node(k), schema._get_node(k)
            if isinstance(child, DictConfig) and isinstance(schild, DictConfig):
                walk(child, schild, full + ".")

    walk(cfg, _schema(), "")


# --------------------------------------------------------------------------- recipes


def _search_dirs(search_paths: Iterable[Union[str, os.PathLike]]) -> list[Path]:
    dirs = [Path(__file__).resolve().parent]
    for sp in search_paths:
        s = str(sp)
        if s.startswith("pkg://"):
            import importlib.util

            spec = importlib.util.find_spec(s[len("pkg://"):])
            if spec is not None and spec.submodule_search_locations:
                dirs += [Path(p) for p in spec.submodule_search_locations]
            continue
        dirs.append(Path(s[len("file://"):] if s.startswith("file://") else s))
    return dirs


def list_recipes(search_paths: Iterable[Union[str, os.PathLike]] = ()) -> list[str]:
    """Names of the recipes (``recipe/<name>.yaml``) in this package and in the extra config
    directories ``search_paths`` (plain paths, ``file://`` or ``pkg://``), sorted."""
    names = set()
    for d in _search_dirs(search_paths):
        rd = d / RECIPE_GROUP
        if rd.is_dir():
            names.update(p.stem for p in rd.glob("*.yaml"))
            names.update(p.stem for p in rd.glob("*.yml"))
    return sorted(names)


# --------------------------------------------------------------------------- compose


def _override_source(line: str) -> str:
    return f"command-line override {line!r}"


def _precheck_overrides(overrides: Sequence[str]) -> list[str]:
    """Parse the overrides with Hydra's grammar; reject keys that are not in the schema (including
    ``+key=value`` additions, which Hydra would accept) and deletions of schema keys.

    Returns the recipe names selected by ``recipe=NAME`` overrides (in order).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as e:
        raise ConfigError(f"Cannot parse command-line override: {e}\n"
                          "Overrides look like key=value, e.g. trainer.total_training_steps=10 or "
                          "data.train_files=[a.jsonl,b.jsonl].") from None
    recipes: list[str] = []
    for ov in parsed:
        key = ov.key_or_group
        if ov.package is not None:
            raise ConfigError(f"{_override_source(ov.input_line)}: package overrides (key@pkg) are not supported.")
        if key == "hydra" or key.startswith("hydra."):
            continue
        if key == RECIPE_GROUP:
            if not ov.is_delete():
                recipes.append(str(ov.value()) if ov.value() is not None else "null")
            continue
        if ov.is_delete():
            raise ConfigError(f"{_override_source(ov.input_line)}: keys of the schema cannot be deleted; "
                              f"set a value instead (e.g. {key}=null where the key allows None).")
        parts = _split_key(key)
        if _first_bad_part(parts) is not None:
            raise _unknown_key_error(key, _override_source(ov.input_line))
    return recipes


def _exception_chain(e: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return chain


def _composition_source(e: BaseException, overrides: Sequence[str]) -> str:
    m = re.search(r"In '([^']+)'", str(e))
    if m:
        return f"in {m.group(1)}.yaml"
    m = re.search(r"Error merging override (\S+)", str(e))
    if m and m.group(1) in overrides:
        return _override_source(m.group(1))
    m = re.search(r"Could not override '([^']+)'", str(e))
    if m:
        for line in overrides:
            if line.split("=", 1)[0].lstrip("+~") == m.group(1):
                return _override_source(line)
    return ""


def _translate_hydra_error(e: BaseException, overrides: Sequence[str]) -> ConfigError:
    """Turn a Hydra/OmegaConf composition error into a short ConfigError."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import ConfigKeyError as OCKeyError, InterpolationResolutionError
    from omegaconf.errors import ValidationError as OCValidationError

    chain = _exception_chain(e)
    source = _composition_source(e, overrides)
    if isinstance(e, MissingConfigException):
        msg = str(e)
        m = re.search(rf"Could not find '{RECIPE_GROUP}/([^']+)'", msg)
        if m:
            name = m.group(1)
            am = re.search(rf"Available options in '{RECIPE_GROUP}':\n((?:\t[^\n]*\n?)*)", msg)
            avail = [s.strip() for s in am.group(1).splitlines() if s.strip()] if am else list_recipes()
            close = difflib.get_close_matches(name, avail, n=3, cutoff=0.5)
            return ConfigKeyError(
                f"Unknown recipe {name!r}."
                + (f" Did you mean: {', '.join(close)}?" if close else "")
                + f"\nAvailable recipes: {', '.join(avail) or '(none)'}",
                key=name, suggestions=close, source="recipe=")
        return ConfigError(msg.split("\nConfig search path:")[0])
    for c in chain:
        if isinstance(c, InterpolationResolutionError):
            full_key = getattr(c, "full_key", None) or "?"
            first = str(c).splitlines()[0]
            m = re.search(r"Interpolation key '([^']+)' not found", first)
            hint = ""
            if m and _first_bad_part(_split_key(m.group(1))) is not None:
                near = nearest_keys(m.group(1))
                hint = f" Did you mean: {', '.join(near)}?" if near else ""
            return ConfigValidationError([f"{full_key}: {first}" + (f" ({source})" if source else "") + "." + hint])
    for c in chain:
        if isinstance(c, (OCKeyError, AttributeError)) and getattr(c, "full_key", None):
            if _first_bad_part(_split_key(c.full_key)) is not None:
                return _unknown_key_error(c.full_key, source)
    for c in chain:
        if isinstance(c, OCValidationError) and getattr(c, "full_key", None):
            first = str(c).splitlines()[0]
            return ConfigValidationError([f"{c.full_key}: {first}" + (f" ({source})" if source else "")])
    first = str(e).split("\nConfig search path:")[0]
    cause = chain[-1] if len(chain) > 1 else None
    if cause is not None:
        first += f"\n{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    return ConfigError(first)


def compose_config(overrides: Sequence[str] = (), recipe: Optional[str] = None, *,
                   search_paths: Sequence[Union[str, os.PathLike]] = (), resolve: bool = True) -> DictConfig:
    """Compose the training config: schema defaults < ``ppo_trainer.yaml`` < recipe < ``overrides``.

    Args:
        overrides: Hydra overrides, e.g. ``["trainer.total_training_steps=5", "data.train_files=x.jsonl"]``;
            may contain ``recipe=NAME`` instead of the ``recipe`` argument.
        recipe: name of ``recipe/<name>.yaml`` (None: the overrides' ``recipe=``, else no recipe).
        search_paths: extra config directories (plain paths, ``file://`` or ``pkg://``) searched after
            this package, e.g. one holding your own ``recipe/my_run.yaml``.
        resolve: resolve ``${...}`` interpolations in place (every rank then sees plain values).

    Returns:
        The composed DictConfig in struct mode (reading or setting an unknown key raises), typed by
        :class:`rlhf.config.schema.RLHFConfig`; ``OmegaConf.to_object(cfg)`` gives the dataclass.

    Raises:
        ConfigKeyError: a key not in the schema (override or recipe file) or an unknown recipe; the
            message names the key, its source and the nearest valid keys.
        ConfigValidationError: a value of the wrong type (e.g. ``trainer.total_epochs=abc``) or a bad
            interpolation.
        ConfigError: any other composition problem (malformed override, conflicting recipes).
    """
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(overrides, str):
        raise TypeError("compose_config: overrides must be a list of 'key=value' strings, not one string")
    overrides = [str(o) for o in overrides]
    recipes = _precheck_overrides(overrides)
    if recipe is not None:
        if any(r != recipe for r in recipes):
            raise ConfigError(f"compose_config: recipe={recipe!r} conflicts with override "
                              f"'recipe={recipes[-1]}'; give the recipe once.")
        if not recipes:
            overrides = [f"{RECIPE_GROUP}={recipe}", *overrides]
    if search_paths:
        if any(o.split("=", 1)[0].lstrip("+") == "hydra.searchpath" for o in overrides):
            raise ConfigError("compose_config: give extra config directories either as search_paths or as a "
                              "hydra.searchpath override, not both.")
        uris = [s if re.match(r"^(file|pkg)://", str(s)) else f"file://{Path(s).resolve()}" for s in map(str, search_paths)]
        overrides.append("hydra.searchpath=[" + ",".join(uris) + "]")

    register_configs()
    gh = GlobalHydra.instance()
    backup = _hydra_backup()
    if gh.is_initialized():  # e.g. called from inside a @hydra.main app: compose on our own, then restore
        gh.clear()
    try:
        with initialize_config_module(config_module=_CONFIG_MODULE, version_base="1.3"):
            try:
                cfg = compose(config_name=BASE_CONFIG_NAME, overrides=overrides)
            except (HydraException, OmegaConfBaseException) as e:
                raise _translate_hydra_error(e, overrides) from None
    finally:
        _hydra_restore(backup)

    _check_closed(cfg)
    if resolve:
        try:
            OmegaConf.resolve(cfg)
        except OmegaConfBaseException as e:
            bad = _first_unresolvable_key(cfg)
            first = str(e).splitlines()[0]
            m = re.search(r"Interpolation key '([^']+)' not found", first)
            near = nearest_keys(m.group(1)) if m else []
            raise ConfigValidationError([f"{bad or '?'}: {first}." + (f" Did you mean: {', '.join(near)}?" if near else "")]) from None
    return cfg


def _first_unresolvable_key(cfg: DictConfig) -> Optional[str]:
    """Full key of the first value whose ``${...}`` interpolation fails to resolve (None if all do)."""
    from omegaconf.errors import OmegaConfBaseException

    def walk(node: Any, prefix: str) -> Optional[str]:
        keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
        for k in keys:
            full = f"{prefix}.{k}" if prefix and isinstance(node, DictConfig) else (f"{prefix}[{k}]" if prefix else str(k))
            try:
                child = node[k]
            except OmegaConfBaseException:
                return full
            if isinstance(child, (DictConfig, ListConfig)):
                found = walk(child, full)
                if found:
                    return found
        return None

    return walk(cfg, "")


def _hydra_backup() -> Any:
    from hydra.initialize import get_gh_backup

    return get_gh_backup()


def _hydra_restore(backup: Any) -> None:
    from hydra.initialize import restore_gh_from_backup

    restore_gh_from_backup(backup)


# --------------------------------------------------------------------------- validate

ROLLOUT_MODES = ("colocated", "disaggregated")
ROLLOUT_NAMES = ("sglang",)
ALGORITHM_NAMES = ("ppo", "dpo")
RESUME_MODES = ("auto", "disable", "resume_path")
KL_CTRL_TYPES = ("fixed", "adaptive")
MODEL_DTYPES = ("float32", "bfloat16")
ROLLOUT_DTYPES = ("auto", "float32", "bfloat16", "float16")
RECOMPUTE_MODES = (None, "full", "selective")
LOGGER_BACKENDS = ("console", "tensorboard")
LR_DECAY_STYLES = ("constant", "linear", "cosine")  # rlhf/mcore/optim.py
#: estimators whose baseline is computed over the rollout.n responses of a prompt
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")


def _valid_adv_estimators() -> list[str]:
    from rlhf.algorithms.advantages import ADV_ESTIMATOR_REGISTRY, AdvantageEstimator

    return sorted(set(ADV_ESTIMATOR_REGISTRY) | {e.value for e in AdvantageEstimator})


def _valid_kl_penalties() -> list[str]:
    from rlhf.algorithms import kl as _kl

    names = sorted(getattr(_kl, "_MODE_ALIASES", {"kl": 0, "k1": 0, "abs": 0, "mse": 0, "k2": 0,
                                                  "low_var_kl": 0, "k3": 0}))
    return names + [n + "+" for n in names]


def _loss_agg_modes() -> list[str]:
    from rlhf.algorithms.losses import LOSS_AGG_MODES

    return list(LOSS_AGG_MODES)


def _check_context_length(cfg: DictConfig, add) -> None:
    """When model.path is a local HF directory, prompt + response must fit its max_position_embeddings
    (SGLang refuses a longer context)."""
    import json

    path = OmegaConf.select(cfg, "model.path")
    cfg_file = Path(str(path)) / "config.json" if path and "://" not in str(path) else None
    if cfg_file is None or not cfg_file.is_file():
        return
    try:
        hf = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    max_pos = hf.get("max_position_embeddings") or (hf.get("text_config") or {}).get("max_position_embeddings")
    p, r = OmegaConf.select(cfg, "data.max_prompt_length"), OmegaConf.select(cfg, "data.max_response_length")
    if isinstance(max_pos, int) and isinstance(p, int) and isinstance(r, int) and p + r > max_pos:
        add(f"data.max_prompt_length={p} + data.max_response_length={r} = {p + r} exceeds the model's "
            f"max_position_embeddings={max_pos} ({cfg_file}); lower them so they fit.")


def validate_config(cfg: DictConfig, world_size: Optional[int] = None) -> None:
    """Check values the schema's types cannot: choices, ranges, batch-size divisibility, settings that
    need each other.  All problems are collected and raised together.

    Args:
        cfg: a config from :func:`compose_config`.
        world_size: number of trainer processes (torchrun / Slurm tasks) when known; enables the checks
            that depend on the data-parallel size ``world_size / (tp * pp)``.

    Raises:
        ConfigValidationError: one line per problem, naming the key, its value and the fix.
    """
    problems: list[str] = []
    add = problems.append

    def get(key: str) -> Any:
        return OmegaConf.select(cfg, key, throw_on_missing=False)

    def choice(key: str, valid: Sequence[Any], fix: str = "") -> None:
        v = get(key)
        if v not in valid:
            close = difflib.get_close_matches(str(v), [str(x) for x in valid if x is not None], n=1, cutoff=0.6)
            hint = f" (did you mean {key}={close[0]}?)" if close else ""
            shown = ", ".join("null" if x is None else str(x) for x in valid)
            add(f"{key}={v!r} is not one of [{shown}]{hint}" + (f"; {fix}" if fix else "") + ".")

    def at_least(key: str, lo: float, allow_none: bool = False, fix: str = "") -> None:
        v = get(key)
        if v is None and allow_none:
            return
        if v is None or v < lo:
            add(f"{key}={v!r} must be >= {lo}" + (" (or null)" if allow_none else "")
                + (f"; {fix}" if fix else "") + ".")

    # ---- data
    for k in ("data.max_prompt_length", "data.max_response_length", "data.train_batch_size", "data.val_batch_size"):
        at_least(k, 1)
    at_least("data.max_train_samples", 1, allow_none=True, fix="use null for all samples")
    at_least("data.max_val_samples", 1, allow_none=True, fix="use null for all samples")
    for k in ("data.train_files", "data.val_files"):
        v = get(k)
        if v is None or v == "" or (isinstance(v, (list, ListConfig)) and len(v) == 0):
            add(f"{k}={v!r} is empty; give a .jsonl/.parquet path (or a list of them) or embedded://arithmetic.")

    # ---- model
    if not get("model.path"):
        add("model.path is empty; give an HF directory, a hub name or tiny://quickstart.")
    choice("model.dtype", MODEL_DTYPES, "bfloat16 on GPU, float32 on CPU")
    _check_context_length(cfg, add)

    # ---- parallel
    tp, pp = get("parallel.tensor_model_parallel_size"), get("parallel.pipeline_model_parallel_size")
    at_least("parallel.tensor_model_parallel_size", 1)
    at_least("parallel.pipeline_model_parallel_size", 1)
    vpp = get("parallel.virtual_pipeline_model_parallel_size")
    if vpp is not None and (vpp < 1 or (pp or 1) < 2):
        add(f"parallel.virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 1 "
            f"(got {pp}) and a value >= 1; set it to null.")
    choice("parallel.recompute", RECOMPUTE_MODES, "null (off), full or selective")
    dp: Optional[int] = None
    if world_size is not None and isinstance(tp, int) and isinstance(pp, int) and tp >= 1 and pp >= 1:
        if world_size % (tp * pp) != 0:
            add(f"parallel.tensor_model_parallel_size={tp} x parallel.pipeline_model_parallel_size={pp} = {tp * pp} "
                f"does not divide "
                f"the {world_size} trainer processes; launch a multiple of {tp * pp} processes "
                f"(e.g. torchrun --nproc_per_node={tp * pp}) or change the parallel sizes.")
        else:
            dp = world_size // (tp * pp)

    # ---- actor / critic batch sizes
    tbs = get("data.train_batch_size")
    n = get("rollout.n")
    for role in ("actor", "critic"):
        at_least(f"{role}.ppo_epochs", 1)
        at_least(f"{role}.ppo_micro_batch_size_per_gpu", 1)
        mbs = get(f"{role}.ppo_mini_batch_size")
        if not isinstance(mbs, int) or mbs < 1:
            add(f"{role}.ppo_mini_batch_size={mbs!r} must be >= 1.")
            continue
        if isinstance(tbs, int) and tbs >= 1:
            if mbs > tbs:
                add(f"{role}.ppo_mini_batch_size={mbs} is larger than data.train_batch_size={tbs}; "
                    f"set {role}.ppo_mini_batch_size to a divisor of {tbs}.")
            elif tbs % mbs != 0:
                divs = [d for d in range(1, tbs + 1) if tbs % d == 0]
                near = min(divs, key=lambda d: abs(d - mbs))
                add(f"{role}.ppo_mini_batch_size={mbs} does not divide data.train_batch_size={tbs}; "
                    f"use a divisor such as {role}.ppo_mini_batch_size={near}.")
        # No divisibility check for the micro batch: the workers shrink it to a divisor of the local batch.
        # The data-parallel split is checked only when the mini batch is fine (else it repeats the above).
        mini_ok = isinstance(tbs, int) and 1 <= mbs <= tbs and tbs % mbs == 0
        if mini_ok and dp and isinstance(n, int) and n >= 1 and (mbs * n) % dp != 0:
            add(f"{role}.ppo_mini_batch_size={mbs} x rollout.n={n} = {mbs * n} sequences per mini-batch do not "
                f"split over data-parallel size {dp}; make ppo_mini_batch_size * rollout.n a multiple of {dp}.")
        choice(f"{role}.loss_agg_mode", _loss_agg_modes())
        for ok in ("optim.lr", "optim.min_lr", "optim.weight_decay", "optim.clip_grad", "optim.adam_eps",
                   "optim.lr_warmup_steps"):
            at_least(f"{role}.{ok}", 0)
        for b in ("optim.adam_beta1", "optim.adam_beta2"):
            v = get(f"{role}.{b}")
            if v is None or not 0 <= v < 1:
                add(f"{role}.{b}={v!r} must be in [0, 1).")
        lr, min_lr = get(f"{role}.optim.lr"), get(f"{role}.optim.min_lr")
        if isinstance(lr, (int, float)) and isinstance(min_lr, (int, float)) and min_lr > lr:
            add(f"{role}.optim.min_lr={min_lr} is above {role}.optim.lr={lr}; lower min_lr.")
        choice(f"{role}.optim.lr_decay_style", LR_DECAY_STYLES)
    at_least("actor.log_prob_micro_batch_size_per_gpu", 1)

    # ---- actor loss
    cr = get("actor.clip_ratio")
    if cr is None or cr <= 0:
        add(f"actor.clip_ratio={cr!r} must be > 0 (PPO uses 0.2).")
    for k in ("actor.clip_ratio_low", "actor.clip_ratio_high"):
        v = get(k)
        if v is not None and v <= 0:
            add(f"{k}={v!r} must be > 0, or null to use actor.clip_ratio.")
    crc = get("actor.clip_ratio_c")
    if crc is None or crc <= 1:
        add(f"actor.clip_ratio_c={crc!r} must be > 1 (dual-clip lower bound; verl uses 3.0).")
    if get("actor.use_kl_loss"):
        choice("actor.kl_loss_type", _valid_kl_penalties())
        at_least("actor.kl_loss_coef", 0)

    # ---- critic
    est = get("algorithm.adv_estimator")
    if get("critic.enable") is False and est == "gae":
        add("critic.enable=false but algorithm.adv_estimator=gae needs a critic (value function); set "
            "critic.enable=null/true, or pick a critic-free estimator such as algorithm.adv_estimator=grpo.")
    cv = get("critic.cliprange_value")
    if cv is None or cv <= 0:
        add(f"critic.cliprange_value={cv!r} must be > 0 (verl uses 0.5).")

    # ---- rollout
    choice("rollout.name", ROLLOUT_NAMES, "SGLang is the rollout engine")
    choice("rollout.mode", ROLLOUT_MODES,
           "colocated: engines share the trainer's devices; disaggregated: engines on devices of their own")
    for k in ("rollout.tensor_model_parallel_size", "rollout.num_engines", "rollout.n", "rollout.val_kwargs.n",
              "rollout.weight_sync_bucket_mb"):
        at_least(k, 1)
    at_least("rollout.max_restarts", 0)
    for pre in ("rollout", "rollout.val_kwargs"):
        at_least(f"{pre}.temperature", 0, fix="0 is greedy")
        tp_ = get(f"{pre}.top_p")
        if tp_ is None or not 0 < tp_ <= 1:
            add(f"{pre}.top_p={tp_!r} must be in (0, 1] (1.0 disables nucleus sampling).")
        tk = get(f"{pre}.top_k")
        if tk is None or (tk != -1 and tk < 1):
            add(f"{pre}.top_k={tk!r} must be -1 (disabled) or >= 1.")
    mf = get("rollout.mem_fraction_static")
    if mf is None or not 0 < mf < 1:
        add(f"rollout.mem_fraction_static={mf!r} must be in (0, 1) (fraction of device memory for SGLang's "
            f"weights + KV cache; ~0.5 when colocated with the trainer).")
    choice("rollout.dtype", ROLLOUT_DTYPES)

    # ---- algorithm
    choice("algorithm.name", ALGORITHM_NAMES)
    valid_est = _valid_adv_estimators()
    choice("algorithm.adv_estimator", valid_est)
    if get("algorithm.name") == "ppo" and est in GROUP_ESTIMATORS and isinstance(n, int) and n < 2:
        add(f"algorithm.adv_estimator={est} computes its baseline over the responses of each prompt and needs "
            f"rollout.n >= 2 (got {n}); set rollout.n=4 or more, or use algorithm.adv_estimator=gae.")
    for k in ("algorithm.gamma", "algorithm.lam"):
        v = get(k)
        if v is None or not 0 <= v <= 1:
            add(f"{k}={v!r} must be in [0, 1] (1.0 for outcome rewards).")
    if get("algorithm.use_kl_in_reward"):
        choice("algorithm.kl_penalty", _valid_kl_penalties())
    choice("algorithm.kl_ctrl.type", KL_CTRL_TYPES)
    at_least("algorithm.kl_ctrl.kl_coef", 0)
    if get("algorithm.kl_ctrl.type") == "adaptive":
        for k in ("algorithm.kl_ctrl.target_kl", "algorithm.kl_ctrl.horizon"):
            v = get(k)
            if v is None or v <= 0:
                add(f"{k}={v!r} must be > 0 for algorithm.kl_ctrl.type=adaptive.")

    # ---- reward
    rpath = get("reward.custom_reward_function.path")
    if rpath and not Path(rpath).is_file():
        add(f"reward.custom_reward_function.path={rpath!r} is not a file (relative to the working directory "
            f"{os.getcwd()}); give the path of a .py file defining "
            f"{get('reward.custom_reward_function.name')}(data_source, solution_str, ground_truth, extra_info).")
    to = get("reward.timeout_s")
    if to is not None and to <= 0:
        add(f"reward.timeout_s={to!r} must be > 0, or null for no timeout.")

    # ---- trainer
    at_least("trainer.total_epochs", 1)
    at_least("trainer.total_training_steps", 1, allow_none=True, fix="null trains for trainer.total_epochs")
    for k in ("trainer.save_freq", "trainer.test_freq"):
        v = get(k)
        if v is None or (v != -1 and v < 1):
            add(f"{k}={v!r} must be -1 (never) or a number of steps >= 1.")
    choice("trainer.resume_mode", RESUME_MODES,
           "auto resumes from the latest checkpoint in trainer.default_local_dir, disable starts fresh, "
           "resume_path loads trainer.resume_from_path")
    mode, rfp = get("trainer.resume_mode"), get("trainer.resume_from_path")
    if mode == "resume_path" and not rfp:
        add("trainer.resume_mode=resume_path needs trainer.resume_from_path=<checkpoint dir>.")
    if rfp and mode in ("auto", "disable"):
        add(f"trainer.resume_from_path={rfp!r} is ignored with trainer.resume_mode={mode}; "
            f"set trainer.resume_mode=resume_path (or drop resume_from_path).")
    loggers = get("trainer.logger")
    bad = [b for b in (loggers or []) if b not in LOGGER_BACKENDS]
    if bad:
        add(f"trainer.logger has unknown backends {bad}; use a subset of {list(LOGGER_BACKENDS)}, "
            f"e.g. trainer.logger=[console,tensorboard].")
    at_least("trainer.max_ckpt_to_keep", 1, allow_none=True, fix="null keeps all")
    if not get("trainer.default_local_dir"):
        add("trainer.default_local_dir is empty; give the output directory for checkpoints and logs.")

    if problems:
        raise ConfigValidationError(problems)

"""verl's key layout as an alias layer onto our schema.

A verl command line (``actor_rollout_ref.actor.optim.lr=1e-6 critic.model.path=... trainer.logger=console``) or
a verl-style YAML file is rewritten into our keys by the rules of :mod:`rlhf.config.verl.keys` before composing:
a key of our own schema stays as it is; a verl key is renamed (``actor_rollout_ref.rollout.gpu_memory_utilization``
-> ``rollout.mem_fraction_static``, ``critic.model.path`` -> ``model.critic_path``), has its value rewritten
(``trainer.logger=console`` -> ``[console]``), is accepted without effect (an engine or throughput knob), is
accepted only at its "off" value (``lora.dropout=0``), or must equal our value after composing (the reference's and
critic's parallel layout).  Every setting we cannot honour is collected, with the reason and what to use instead,
so all of them are reported together (:func:`translate_items`).
"""
from __future__ import annotations

import re
from fnmatch import fnmatchcase
from functools import lru_cache
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

from rlhf.config.keys import first_bad_part, is_dict_field, split_key
from rlhf.config.verl.keys import OURS, REWARD_MODEL_PREFIX, RULES, Unsupported
from rlhf.config.verl.megatron_keys import is_verl_default

__all__ = ["Item", "Translated", "translate_items", "translate_key", "match_rule", "items_from_overrides",
           "check_same", "ignored_lines", "verl_engine_count"]


@dataclass
class Item:
    """One setting: ``key`` = ``value`` (Python), ``raw`` its override text when it came from a command line
    (kept verbatim for a plain rename), ``prefix`` ``+``/``++``, ``source`` where it came from."""

    key: str
    value: Any
    raw: Optional[str] = None
    prefix: str = ""
    source: str = ""
    parsed: bool = True  # False: the value is a sweep / not a single element (only renamed)


@dataclass
class Translated:
    """What :func:`translate_items` made of the items."""

    overrides: list = field(default_factory=list)  # override strings in our keys
    problems: list = field(default_factory=list)  # unsupported settings, one line each
    same: list = field(default_factory=list)  # (our key, value, verl key, source): must be equal after composing
    ignored: list = field(default_factory=list)  # (verl key, source, why) accepted without effect
    notes: list = field(default_factory=list)  # substitutions worth telling (vllm read as sglang)
    unknown: list = field(default_factory=list)  # ConfigKeyError per verl-layout key that is not ours either
    origins: dict = field(default_factory=dict)  # override string -> where its setting came from
    speaks_verl: bool = False  # some setting used verl's actor_rollout_ref.* layout


@lru_cache(maxsize=None)
def _pattern(pattern: str) -> tuple[tuple[str, ...], bool]:
    """(parts, deep) of a rule pattern: its dotted parts without a trailing ``**``, and whether it had one."""
    pp = tuple(pattern.split("."))
    return (pp[:-1], True) if pp[-1] == "**" and pp[0] != "**" else (pp, False)


def _matches(pattern: str, key: str) -> Optional[str]:
    """The part of ``key`` matched before a trailing ``**`` (the whole key for exact patterns), or None."""
    pp, deep = _pattern(pattern)
    kp = key.split(".")
    if pp[0] == "**":  # "**._target_": any depth, fixed tail
        tail = list(pp[1:])
        return key if len(kp) >= len(tail) and kp[-len(tail):] == tail else None
    if (len(kp) < len(pp)) if deep else (len(kp) != len(pp)):
        return None
    if pp[0] not in ("*", kp[0]) and "*" not in pp[0]:  # most rules fail on the first part
        return None
    if all(p in ("*", k) or ("*" in p and fnmatchcase(k, p)) for p, k in zip(pp, kp)):
        return ".".join(kp[:len(pp)])
    return None


def match_rule(key: str, rules: Iterable[tuple] = RULES) -> Optional[tuple]:
    """(action, arg, matched prefix) of the first rule matching ``key``, or None."""
    if rules is RULES or rules is OURS:
        return _match_table(key, rules is OURS)
    return _match(key, rules)


@lru_cache(maxsize=8192)
def _match_table(key: str, ours: bool) -> Optional[tuple]:
    return _match(key, OURS if ours else RULES)


def _match(key: str, rules: Iterable[tuple]) -> Optional[tuple]:
    for pattern, action, arg in rules:
        head = _matches(pattern, key)
        if head is not None:
            return action, arg, head
    return None


@lru_cache(maxsize=8192)
def _in_schema(key: str) -> bool:
    return first_bad_part(split_key(key)) is None


def translate_key(key: str) -> Optional[str]:
    """Our key for a verl key when it is a plain rename (map / prefix), else None; our own keys map to
    themselves.  Used to rewrite ``${...}`` interpolations."""
    if _in_schema(key):
        return key
    rule = match_rule(key)
    if rule is None:
        return None
    action, arg, head = rule
    if action == "map":
        return arg
    if action == "prefix":
        ours = arg + key[len(head):]
        return ours if _in_schema(ours) else None
    return None


_INTERP_KEY = re.compile(r"(?<=[{:,\s])([A-Za-z_]\w*(?:\.\w+)+)(?=\s*[},])")


def _rewrite_interpolation(value: Any) -> Any:
    """``${actor_rollout_ref.actor.ppo_mini_batch_size}`` -> ``${actor.ppo_mini_batch_size}`` (keys we know)."""
    if not isinstance(value, str) or "${" not in value:
        return value
    return _INTERP_KEY.sub(lambda m: translate_key(m.group(1)) or m.group(1), value)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, str) and isinstance(b, str):
        return a.lower() == b.lower()
    try:
        return a == b
    except Exception:  # noqa: BLE001
        return False


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


def _line(item: Item, key: str, value: Any = None, verbatim: bool = False) -> str:
    from rlhf.config.overrides import format_value

    text = item.raw if verbatim and item.raw is not None else format_value(_rewrite_interpolation(value))
    return f"{_prefix(item, key, value)}{key}={text}"


def _prefix(item: Item, key: str, value: Any) -> str:
    """``++`` (add or replace) where Hydra's plain ``key=`` or ``+key=`` would refuse: a whole dict for a
    dict-valued field, a key inside one, and verl's ``+key`` (a key verl's base lacks) for one that we have."""
    if item.prefix:
        return "++" if item.prefix == "+" and key != item.key else item.prefix
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    if (isinstance(value, dict) and is_dict_field(key)) or (parent and is_dict_field(parent)):
        return "++"
    return ""


def _where(item: Item) -> str:
    """`` (where the setting came from)``, a long command-line override cut (it repeats the value)."""
    src = item.source
    if len(src) > 120:
        src = f"{src[:100]}...' ({len(src)} characters)"
    return f" ({src})" if src else ""


def _apply(item: Item, rule: tuple, out: Translated, reward_model: dict) -> None:
    action, arg, head = rule
    key, value = item.key, item.value
    if action == "map":
        out.overrides.append(_line(item, arg, value, verbatim=True))
    elif action == "prefix":
        ours = arg + key[len(head):]
        if _in_schema(ours):
            out.overrides.append(_line(item, ours, value, verbatim=True))
        else:
            out.unknown.append(_unknown(key, ours, item))
    elif action == "fn":
        if not item.parsed:
            out.problems.append(f"{key}: only a single value is supported here{_where(item)}.")
            return
        try:
            pairs = arg(value)
        except Unsupported as e:
            out.problems.append(f"{key}={_brief(value)} is not supported{_where(item)}: {e}.")
            return
        except (TypeError, ValueError) as e:
            out.problems.append(f"{key}={_brief(value)}: {e}{_where(item)}.")
            return
        for k, v in pairs:
            out.overrides.append(_line(item, k, v))
        if key.endswith("rollout.name") and value == "vllm":
            out.notes.append(f"{key}=vllm: the rollout engine here is SGLang (same sampling settings).")
    elif action == "same":
        if not _is_interpolation(value):
            out.same.append((arg, value, key, item.source))
    elif action == "neutral":
        values, why = arg
        if not _is_interpolation(value) and not any(_same(value, v) for v in values):
            shown = ", ".join(_show(v) for v in values)
            out.problems.append(f"{key}={_brief(value)} is not supported{_where(item)}: {why} (accepted: {shown}).")
    elif action == "refuse":
        out.problems.append(f"{key}={_brief(value)} is not supported{_where(item)}: {arg}.")
    elif action == "ignore":
        out.ignored.append((key, item.source, arg))
    elif action == "reward_model":
        reward_model[arg] = (value, item)


def _unknown(key: str, ours: str, item: Item) -> Any:
    """The unknown-key error for verl's ``key``, read here as ``ours``: suggestions from our schema."""
    from rlhf.config.errors import ConfigKeyError
    from rlhf.config.keys import unknown_key_error

    err = unknown_key_error(ours, item.source)
    rest = str(err).splitlines()[1:]
    head = f"Unknown config key {key!r} (read as {ours!r}" + (f"; {item.source}" if item.source else "") + ")."
    return ConfigKeyError("\n".join([head, *rest]), key=key, suggestions=err.suggestions, source=item.source)


def _brief(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (a chat template is thousands) with the full length named."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _show(v: Any) -> str:
    return "null" if v is None else ("true" if v is True else "false" if v is False else repr(v))


def _reward_model_source(reward_model: dict, out: Translated) -> None:
    """verl's reward_model.enable + model.path -> one model source in reward.sources."""
    enable = reward_model.get("enable", (None, None))[0]
    if enable is not True:
        return
    path, item = reward_model.get("path", (None, None))
    if not path or _is_interpolation(path):
        out.problems.append("reward_model.enable=True needs reward_model.model.path=<HF reward model>.")
        return
    source: dict = {"type": "model", "path": path, "weight": 1.0}
    for name in ("micro_batch_size", "max_length"):
        v = reward_model.get(name, (None, None))[0]
        if v is not None and not _is_interpolation(v):
            source[name] = v
    out.overrides.append(_line(item, "reward.sources", [source]))


def translate_items(items: Sequence[Item]) -> Translated:
    """Rewrite ``items`` (verl's keys or ours) into override strings of our schema.

    A key given more than once counts at its last occurrence (the command line wins over a config file); a
    config file's verl default for a key in :data:`~rlhf.config.verl.megatron_keys.VERL_DEFAULTS` is skipped.
    Keys that are neither ours nor verl's stay as they are, so composing reports them with the nearest
    valid keys.  Group choices (``recipe=``, ``algorithm=``), ``hydra.*`` and deletions pass through."""
    out, reward_model = Translated(), {}
    last = {item.key: i for i, item in enumerate(items)}
    for i, item in enumerate(items):
        if last[item.key] != i:  # given again later (the command line after a config file): the later one counts
            continue
        if item.source.startswith("config file") and is_verl_default(item.key, item.value):
            continue  # verl's default, not chosen by the user: our setting stays
        before = len(out.overrides)
        out.speaks_verl |= item.key.lstrip("+").startswith("actor_rollout_ref.")
        _translate_one(item, out, reward_model)
        for line in out.overrides[before:]:
            out.origins.setdefault(line, item.source)
    _reward_model_source(reward_model, out)
    return out


def _translate_one(item: Item, out: Translated, reward_model: dict) -> None:
    key = item.key
    rule = match_rule(key, OURS)
    passthrough = key in ("recipe", "algorithm") or key == "hydra" or key.startswith("hydra.")
    if passthrough or (rule is None and _in_schema(key)):
        out.overrides.append(_line(item, key, item.value, verbatim=True))
        return
    rule = rule or match_rule(key)
    if rule is None:  # neither ours nor verl's: composing reports it with the nearest keys
        out.overrides.append(_line(item, key, item.value, verbatim=True))
        return
    _apply(item, rule, out, reward_model)


def items_from_overrides(overrides: Sequence[str]) -> tuple[list[Item], list[str]]:
    """Parse override strings into items; deletions (``~key``) and unparsable lines are returned apart
    (they go to composing unchanged, which reports them)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException

    from rlhf.config.overrides import override_source

    items, passthrough = [], []
    parser = OverridesParser.create()
    for line in overrides:
        try:
            ov = parser.parse_overrides([line])[0]
        except HydraException:
            passthrough.append(line)
            continue
        if ov.is_delete() or ov.package is not None:
            passthrough.append(line)
            continue
        prefix = "++" if line.startswith("++") else "+" if line.startswith("+") else ""
        raw = line.split("=", 1)[1] if "=" in line else ""
        single = ov.value_type == ValueType.ELEMENT
        items.append(Item(ov.key_or_group, ov.value() if single else raw, raw, prefix, override_source(line), single))
    return items, passthrough


def check_same(cfg: Any, same: Sequence[tuple]) -> list[str]:
    """The ``same`` constraints that the composed ``cfg`` breaks."""
    from omegaconf import OmegaConf

    out = []
    for ours, value, verl_key, source in same:
        have = OmegaConf.select(cfg, ours)
        if not _same(have, value):
            out.append(f"{verl_key}={value!r} is not supported" + (f" ({source})" if source else "")
                       + f": the reference model and the critic use the actor's layout, {ours}={have!r}; "
                       f"set {ours}={value!r} (actor_rollout_ref.actor.megatron.*) or drop {verl_key}.")
    return out


def verl_engine_count(cfg: Any, translated: Translated) -> Optional[int]:
    """How many rollout engines a verl config means, where it leaves ``rollout.num_engines`` to us: verl's hybrid
    engine runs one rollout replica per ``rollout.tensor_model_parallel_size`` GPUs of the whole job
    (``trainer.nnodes x trainer.n_gpus_per_node``, all of them colocated with the actor), while our schema's
    default is one engine.  None (keep ours) unless the settings speak verl (``actor_rollout_ref.*``), none of them
    sets ``rollout.num_engines``, the composed value is still the schema's one engine (a recipe's own count stays),
    the mode is colocated and the job's GPUs are given (``trainer.n_gpus_per_node``); on a CPU job
    (``trainer.n_gpus_per_node`` null) one engine stays.

    Example: verl's ``trainer.nnodes=2 trainer.n_gpus_per_node=8 actor_rollout_ref.rollout.tensor_model_parallel_size=4``
    -> 4 engines of TP 4 (verl: 4 vLLM/SGLang replicas), not one engine on 4 of the 16 GPUs."""
    if not translated.speaks_verl or any(o.lstrip("+").split("=", 1)[0] == "rollout.num_engines"
                                         for o in translated.overrides):
        return None
    r, t = cfg.rollout, cfg.trainer
    if r.mode != "colocated" or not t.n_gpus_per_node or r.num_engines != 1:
        return None
    return max(1, (t.nnodes or 1) * t.n_gpus_per_node // r.tensor_model_parallel_size)


def ignored_lines(ignored: Sequence[tuple]) -> list[str]:
    """Warning lines naming the verl settings accepted without effect (``Translated.ignored``), so none passes
    silently: command-line keys one by one with the reason; a config file's keys in one line per file, grouped
    by section, deeper keys as ``name.*`` (a verl ``ppo_trainer.yaml`` holds hundreds of engine / worker
    details).  verl's ``_target_``
    class names and ``hydra.*`` are left out (they configure nothing)."""
    by_why: dict = {}
    by_file: dict = {}
    for key, source, why in ignored:
        if key.endswith("._target_") or key == "_target_" or key.startswith("hydra."):
            continue
        if not source or source.startswith("command-line"):
            by_why.setdefault(why, []).append(key)
        else:
            section, _, rest = key.partition(".")
            if "." in rest:
                sub, _, rest = rest.partition(".")
                section = f"{section}.{sub}"
            head, dot, _ = (rest or key).partition(".")
            by_file.setdefault(source, {}).setdefault(section, []).append(head + (".*" if dot else ""))
    out = []
    if by_why:
        out.append("no effect here: " + "; ".join(f"{', '.join(sorted(set(keys)))} ({why})"
                                                  for why, keys in by_why.items()))
    for source, sections in by_file.items():
        n = len({(source, key) for key, src, _ in ignored if src == source and not key.endswith("_target_")})
        listed = "; ".join(f"{sec}.{{{', '.join(sorted(set(v)))}}}" for sec, v in sorted(sections.items()))
        out.append(f"{source}: {n} verl settings have no effect here (engine, worker and profiler details; the "
                   f"reason for each is in rlhf/config/verl/keys.py): {listed}")
    return out


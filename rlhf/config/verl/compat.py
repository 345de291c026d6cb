"""verl's key layout read into ours: the one preprocessing step before composing.

A verl command line (``actor_rollout_ref.actor.optim.lr=1e-6 critic.model.path=... trainer.logger=console``) or a
verl-style YAML file (:mod:`rlhf.config.config_file`) is rewritten into our keys by the table ``keys.yaml`` beside
this module: a key of our own schema stays as it is; a verl key is renamed, has its value rewritten (one of
:data:`FUNCTIONS`), is accepted without effect (warned), accepted only at its "off" value, or must equal our value
after composing (the reference's and critic's parallel layout).  Every setting we cannot honour is collected with
the reason and what to use instead, so all are reported together (:func:`translate_items`).
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from string import Template
from typing import Any, Optional, Sequence

from rlhf.config.errors import ConfigKeyError
from rlhf.config.keys import first_bad_part, is_dict_field, split_key, unknown_key_error

__all__ = ["Item", "Translated", "Unsupported", "translate_items", "translate_key", "items_from_overrides",
           "check_same", "ignored_lines", "verl_engine_count", "is_verl_default", "rule_for"]


class Unsupported(ValueError):
    """A verl value with no equivalent here; the message says why and what to use instead."""


def _choose(allowed: dict, why: str):
    """A value function: the value mapped by ``allowed`` (``None`` values: nothing to set), else Unsupported."""
    def fn(v: Any, to: str) -> list:
        if v not in allowed:
            raise Unsupported(why)
        return [] if allowed[v] is None else [(to, allowed[v])]
    return fn


def _train_dtype(v: Any, to: str) -> list:
    if str(v).lower() in ("float16", "fp16", "half"):  # megatron's fp16 training needs its loss scaler
        raise Unsupported("fp16 training (megatron's dynamic loss scaling) is not supported; train in bfloat16 "
                          "(model.dtype=bfloat16) and serve in float16 if wanted (rollout.dtype=float16)")
    return [(to, v)]


def _dtype(v: Any, to: str) -> list:
    from parallel.optim_config import megatron_dtype_name

    return [] if v is None else [(to, megatron_dtype_name(v))]  # verl's null: megatron's fp32 default


#: the value rewrites of ``{fn: NAME, to: KEY}`` rules: ``fn(value, KEY) -> [(our key, value), ...]``
FUNCTIONS = {
    "logger": lambda v, to: [(to, [v] if isinstance(v, str) else list(v))],
    "betas": lambda v, to: [(f"{to}.adam_beta{i + 1}", b) for i, b in enumerate(list(v)[:2])],
    "warmup_steps": lambda v, to: [] if v is None or v == -1 else [(to, v)],  # verl: -1 = from the ratio
    "samples": lambda v, to: [(to, None if v is None or v < 0 else v)],
    "lora_rank": lambda v, to: [(to, v)] if v else [],  # verl's megatron lora.rank 0 (its default) keeps lora_rank
    "dtype": _dtype,
    "train_dtype": _train_dtype,
    "rollout_name": _choose({"sglang": "sglang", "vllm": "sglang"}, "the rollout engine here is SGLang; use "
                            "rollout.name=sglang (vllm is read as sglang)"),
    "schedule": _choose({None: None, "constant": "constant", "cosine": "cosine", "linear": "linear"},
                        "schedules here are constant, linear and cosine"),
    "recompute": _choose({None: None, "full": "full", "selective": "selective"},
                         "parallel.recompute is null, full or selective"),
    "router_dtype": _choose({None: None, "fp32": "fp32", "fp64": "fp64"}, "model.moe_router_dtype is null, fp32 or "
                            "fp64"),
    "load_balancing": _choose({None: None, "aux_loss": None, "none": 0.0}, "the MoE router balances its load with the "
                              "aux loss (aux_loss, or none: model.moe_aux_loss_coef=0)"),
    "gradient_checkpointing": _choose({None: None, False: None, True: "full"}, "enable_gradient_checkpointing is true "
                                      "or false (true: parallel.recompute=full)"),
    "lora_a_init": _choose({"xavier": "xavier", "kaiming": "kaiming"}, "the LoRA A init here is xavier or kaiming "
                           "(B starts at zero)"),
}


def _expand(pattern: str) -> list[str]:
    """``a.{b,c}.d`` -> ``["a.b.d", "a.c.d"]`` (several braces and empty alternatives too)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    return [x for alt in m.group(1).split(",") for x in _expand(pattern[:m.start()] + alt + pattern[m.end():])]


def _rule(spec: Any) -> tuple:
    """A keys.yaml rule as ``(action, arg)``."""
    if isinstance(spec, str):
        return "map", spec
    kind = next(k for k in ("prefix", "fn", "same", "only", "ignore", "refuse", "reward_model") if k in spec)
    return {"fn": ("fn", (spec.get("fn"), spec.get("to"))), "only": ("neutral", (tuple(spec.get("only", ())),
                                                                              spec.get("why")))}.get(kind,
                                                                                                      (kind, spec[kind]))


@functools.lru_cache(maxsize=1)
def _table() -> tuple[dict, list, dict, dict]:
    """(exact verl rules, pattern rules by priority, rules of our own keys, verl's defaults) from keys.yaml."""
    import yaml

    doc = yaml.safe_load((Path(__file__).with_name("keys.yaml")).read_text(encoding="utf-8"))
    flat: dict = {}
    for key, spec in doc["verl"].items():
        if isinstance(spec, dict) and "use" in spec:  # a template's rules under this key
            text = Template(json.dumps(doc["templates"][spec["use"]])).safe_substitute(spec)
            for sub, sub_spec in json.loads(text).items():
                for at in _expand(key):
                    flat.update({f"{at}.{s}": sub_spec for s in _expand(sub)})
    for key, spec in doc["verl"].items():
        if not (isinstance(spec, dict) and "use" in spec):
            flat.update({k: spec for k in _expand(key)})
    exact = {k: _rule(s) for k, s in flat.items() if "*" not in k}
    patterns = []
    for k, s in flat.items():
        if "*" in k:
            parts = k.split(".")
            deep = parts[-1] == "**" and parts[0] != "**"
            lead = next((i for i, p in enumerate(parts) if "*" in p), len(parts))
            patterns.append(((parts[0] != "**", -lead, deep), parts[:-1] if deep else parts, deep, _rule(s)))
    patterns.sort(key=lambda p: p[0])
    ours = {k: _rule(s) for key, s in doc["ours"].items() for k in _expand(key)}
    defaults = {k: v for key, v in doc["verl_defaults"].items() for k in _expand(key)}
    return exact, [p[1:] for p in patterns], ours, defaults


@functools.lru_cache(maxsize=8192)
def rule_for(key: str, ours: bool = False) -> Optional[tuple]:
    """``(action, arg, matched prefix)`` of keys.yaml for ``key`` (``ours``: the rules of our own keys), or None."""
    exact, patterns, own, _ = _table()
    if ours:
        return (*own[key], key) if key in own else None
    if key in exact:
        return (*exact[key], key)
    kp = key.split(".")
    for pp, deep, rule in patterns:
        if pp[0] == "**":  # any depth, fixed tail
            if len(kp) >= len(pp) - 1 and kp[len(kp) - len(pp) + 1:] == pp[1:]:
                return (*rule, key)
        elif (len(kp) >= len(pp) if deep else len(kp) == len(pp)) and all(
                p == k or p == "*" or ("*" in p and fnmatchcase(k, p)) for p, k in zip(pp, kp)):
            return (*rule, ".".join(kp[:len(pp)]))
    return None


def is_verl_default(key: str, value: Any) -> bool:
    """True when a config file's ``key: value`` is verl's own default for a key that here must agree with another
    setting (keys.yaml ``verl_defaults``): it reads as "not set"."""
    return any(value == v and type(value) is type(v) for v in _table()[3].get(key, ()))


@functools.lru_cache(maxsize=8192)
def _in_schema(key: str) -> bool:
    return first_bad_part(split_key(key)) is None


def _target(target: str, key: str) -> str:
    """A rule's key of ours, its ``*`` the verl key's last part."""
    return target.replace("*", key.rsplit(".", 1)[-1]) if target.endswith("*") else target


def translate_key(key: str) -> Optional[str]:
    """Our key for a verl key that is a plain rename, or our own key itself; None otherwise (used to rewrite
    ``${...}`` interpolations)."""
    if _in_schema(key):
        return key
    rule = rule_for(key)
    if rule is None or rule[0] not in ("map", "prefix"):
        return None
    ours = _target(rule[1], key) if rule[0] == "map" else rule[1] + key[len(rule[2]):]
    return ours if _in_schema(ours) else None


@dataclass
class Item:
    """One setting: ``key`` = ``value`` (Python), ``raw`` its override text when it came from a command line (kept
    verbatim for a plain rename), ``prefix`` ``+``/``++``, ``source`` where it came from, ``parsed`` False for a
    sweep (only renamed)."""

    key: str
    value: Any
    raw: Optional[str] = None
    prefix: str = ""
    source: str = ""
    parsed: bool = True


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


_INTERP_KEY = re.compile(r"(?<=[{:,\s])([A-Za-z_]\w*(?:\.\w+)+)(?=\s*[},])")


def _line(item: Item, key: str, value: Any = None, verbatim: bool = False) -> str:
    """The override line setting our ``key``: ``++`` (add or replace) where Hydra's ``key=`` / ``+key=`` would refuse
    (a dict-valued field or a key inside one, verl's ``+key`` for a key we have); verl keys in ``${...}`` rewritten."""
    from rlhf.config.overrides import format_value

    if isinstance(value, str) and "${" in value:
        value = _INTERP_KEY.sub(lambda m: translate_key(m.group(1)) or m.group(1), value)
    text = item.raw if verbatim and item.raw is not None else format_value(value)
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    prefix = ("++" if item.prefix == "+" and key != item.key else item.prefix) if item.prefix else (
        "++" if (isinstance(value, dict) and is_dict_field(key)) or (parent and is_dict_field(parent)) else "")
    return f"{prefix}{key}={text}"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, str) and isinstance(b, str):
        return a.lower() == b.lower()
    try:
        return a == b
    except Exception:  # noqa: BLE001 - uncomparable values differ
        return False


def _brief(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (a chat template is thousands) with the full length named."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _apply(item: Item, rule: tuple, out: Translated, reward_model: dict) -> None:
    action, arg, head = rule
    key, value = item.key, item.value
    src = item.source if len(item.source) <= 120 else f"{item.source[:100]}...' ({len(item.source)} characters)"
    where, interp = f" ({src})" if src else "", isinstance(value, str) and "${" in value
    if action == "map":
        out.overrides.append(_line(item, _target(arg, key), value, verbatim=True))
    elif action == "prefix":
        ours = arg + key[len(head):]
        if _in_schema(ours):
            out.overrides.append(_line(item, ours, value, verbatim=True))
        else:  # the unknown-key error of our key, naming verl's
            err = unknown_key_error(ours, item.source)
            head_line = f"Unknown config key {key!r} (read as {ours!r}" + (f"; {item.source}" if item.source else "")
            out.unknown.append(ConfigKeyError("\n".join([head_line + ").", *str(err).splitlines()[1:]]), key=key,
                                              suggestions=err.suggestions, source=item.source))
    elif action == "fn":
        if not item.parsed:
            out.problems.append(f"{key}: only a single value is supported here{where}.")
            return
        try:
            pairs = FUNCTIONS[arg[0]](value, _target(arg[1], key) if arg[1] else key)
        except Unsupported as e:
            out.problems.append(f"{key}={_brief(value)} is not supported{where}: {e}.")
            return
        except (TypeError, ValueError) as e:
            out.problems.append(f"{key}={_brief(value)}: {e}{where}.")
            return
        out.overrides += [_line(item, k, v) for k, v in pairs]
        if key.endswith("rollout.name") and value == "vllm":
            out.notes.append(f"{key}=vllm: the rollout engine here is SGLang (same sampling settings).")
    elif action == "same" and not interp:
        out.same.append((_target(arg, key), value, key, item.source))
    elif action == "neutral" and not interp and not any(_same(value, v) for v in arg[0]):
        shown = ", ".join("null" if v is None else json.dumps(v) if isinstance(v, bool) else repr(v) for v in arg[0])
        out.problems.append(f"{key}={_brief(value)} is not supported{where}: {arg[1]} (accepted: {shown}).")
    elif action == "refuse":
        out.problems.append(f"{key}={_brief(value)} is not supported{where}: {arg}.")
    elif action == "ignore":
        out.ignored.append((key, item.source, arg))
    elif action == "reward_model":
        reward_model[arg] = (value, item)


def _reward_model_source(reward_model: dict, out: Translated) -> None:
    """verl's reward_model.enable + model.path -> one model source in reward.sources."""
    if reward_model.get("enable", (None, None))[0] is not True:
        return
    path, item = reward_model.get("path", (None, None))
    if not path or "${" in str(path):
        out.problems.append("reward_model.enable=True needs reward_model.model.path=<HF reward model>.")
        return
    source: dict = {"type": "model", "path": path, "weight": 1.0}
    for name in ("micro_batch_size", "max_length"):
        v = reward_model.get(name, (None, None))[0]
        if v is not None and "${" not in str(v):
            source[name] = v
    out.overrides.append(_line(item, "reward.sources", [source]))


def translate_items(items: Sequence[Item]) -> Translated:
    """Rewrite ``items`` (verl's keys or ours) into override strings of our schema.

    A key given more than once counts at its last occurrence (the command line wins over a config file); a config
    file's value equal to verl's default for a key of keys.yaml ``verl_defaults`` is skipped.  Keys that are neither
    ours nor verl's stay as they are, so composing reports them with the nearest valid keys.  Group choices
    (``recipe=``, ``algorithm=``), ``hydra.*`` and deletions pass through."""
    out, reward_model = Translated(), {}
    last = {item.key: i for i, item in enumerate(items)}
    for i, item in enumerate(items):
        key = item.key
        if last[key] != i or (item.source.startswith("config file") and is_verl_default(key, item.value)):
            continue  # given again later, or verl's default (not chosen by the user): our setting stays
        before = len(out.overrides)
        out.speaks_verl |= key.lstrip("+").startswith("actor_rollout_ref.")
        rule = rule_for(key, ours=True)
        if key in ("recipe", "algorithm") or key.split(".")[0] == "hydra" or (rule is None and _in_schema(key)):
            rule = None
        elif rule is None:
            rule = rule_for(key)
        if rule is None:  # ours, or neither ours nor verl's: composing reports it with the nearest keys
            out.overrides.append(_line(item, key, item.value, verbatim=True))
        else:
            _apply(item, rule, out, reward_model)
        for line in out.overrides[before:]:
            out.origins.setdefault(line, item.source)
    _reward_model_source(reward_model, out)
    return out


def items_from_overrides(overrides: Sequence[str]) -> tuple[list[Item], list[str]]:
    """Parse override strings into items; deletions (``~key``), package overrides and lines Hydra cannot parse are
    returned apart (composing gets them unchanged and reports them)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException

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
        items.append(Item(ov.key_or_group, ov.value() if single else raw, raw, prefix,
                          f"command-line override {line!r}", single))
    return items, passthrough


def check_same(cfg: Any, same: Sequence[tuple]) -> list[str]:
    """The ``same`` constraints (the reference's / critic's layout equals the actor's) that ``cfg`` breaks."""
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
    """The rollout engines a verl config means where it leaves ``rollout.num_engines`` to us: verl's hybrid engine
    runs one replica per ``rollout.tensor_model_parallel_size`` GPUs of the whole job (``trainer.nnodes x
    trainer.n_gpus_per_node``, colocated), our default is one engine.  None (keep ours) unless the settings speak
    verl (``actor_rollout_ref.*``) without setting ``rollout.num_engines``, the composed count is still one, the
    mode colocated and ``trainer.n_gpus_per_node`` given (a CPU job keeps one engine).  E.g. 2 nodes x 8 GPUs at
    rollout TP 4 -> 4 engines of TP 4."""
    if not translated.speaks_verl or any(o.lstrip("+").split("=", 1)[0] == "rollout.num_engines"
                                         for o in translated.overrides):
        return None
    r, t = cfg.rollout, cfg.trainer
    if r.mode != "colocated" or not t.n_gpus_per_node or r.num_engines != 1:
        return None
    return max(1, (t.nnodes or 1) * t.n_gpus_per_node // r.tensor_model_parallel_size)


def ignored_lines(ignored: Sequence[tuple]) -> list[str]:
    """Warning lines naming the verl settings accepted without effect (``Translated.ignored``), so none passes
    silently: command-line keys one by one with the reason; a config file's keys in one line per file, grouped by
    section, deeper keys as ``name.*`` (a verl ppo_trainer.yaml holds hundreds of engine / worker details).
    verl's ``_target_`` class names and ``hydra.*`` are left out (they configure nothing)."""
    by_why: dict = {}
    by_file: dict = {}
    for key, source, why in ignored:
        if key.endswith("_target_") or key.startswith("hydra."):
            continue
        if not source or source.startswith("command-line"):
            by_why.setdefault(why, []).append(key)
            continue
        section, _, rest = key.partition(".")
        if "." in rest:
            sub, _, rest = rest.partition(".")
            section = f"{section}.{sub}"
        head, dot, _ = (rest or key).partition(".")
        by_file.setdefault(source, {}).setdefault(section, []).append(head + (".*" if dot else ""))
    out = ["no effect here: " + "; ".join(f"{', '.join(sorted(set(keys)))} ({why})" for why, keys in by_why.items())
           ] if by_why else []
    for source, sections in by_file.items():
        n = len({key for key, src, _ in ignored if src == source and not key.endswith("_target_")})
        listed = "; ".join(f"{sec}.{{{', '.join(sorted(set(v)))}}}" for sec, v in sorted(sections.items()))
        out.append(f"{source}: {n} verl settings have no effect here (engine, worker and profiler details; the "
                   f"reason for each is in rlhf/config/verl/keys.yaml): {listed}")
    return out

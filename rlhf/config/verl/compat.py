"""verl's key layout read into ours, the one preprocessing step before composing: a verl command line or config
file is rewritten by the table ``keys.yaml`` beside this module (its header says how to read it).  Every setting we
cannot honour is collected with the reason and what to use instead, so all are reported together."""
from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from typing import Any, Optional, Sequence

from rlhf.config.errors import ConfigKeyError
from rlhf.config.keys import first_bad_part, is_dict_field, split_key, unknown_key_error


class Unsupported(ValueError):
    """A verl value with no equivalent here; the message says why and what to use instead."""


def _train_dtype(v: Any, to: str) -> list:
    if str(v).lower() in ("float16", "fp16", "half"):  # megatron's fp16 training needs its loss scaler
        raise Unsupported("fp16 training (megatron's dynamic loss scaling) is not supported; train in bfloat16 "
                          "(model.dtype=bfloat16) and serve in float16 if wanted (rollout.dtype=float16)")
    return [(to, v)]


def _dtype(v: Any, to: str) -> list:
    from parallel.optim_config import megatron_dtype_name

    return [] if v is None else [(to, megatron_dtype_name(v))]  # verl's null: megatron's fp32 default


#: the value rewrites of ``{fn: NAME, to: KEY}`` rules: ``FUNCTIONS[NAME](value, KEY) -> [(our key, value), ...]``
FUNCTIONS = {
    "logger": lambda v, to: [(to, [v] if isinstance(v, str) else list(v))],
    "betas": lambda v, to: [(f"{to}.adam_beta{i + 1}", b) for i, b in enumerate(list(v)[:2])],
    "samples": lambda v, to: [(to, None if v is None or v < 0 else v)],
    "dtype": _dtype,
    "train_dtype": _train_dtype,
}


def keeps_value(rule: dict) -> bool:
    """Whether a value rule keeps the value's meaning (a dtype name; a ``choose`` that maps a value to itself), so an
    error may name the verl key for ours (rlhf.config.verl.words); betas and samples change what it says."""
    return rule.get("fn") in set(FUNCTIONS) - {"betas", "samples"} or any(
        k == v for k, v in (rule.get("choose") or {}).items() if k is not None)


def _expand(pattern: str) -> list[str]:
    """``a.{b,c}.d`` -> ``["a.b.d", "a.c.d"]``."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    return [x for alt in m.group(1).split(",") for x in _expand(pattern[:m.start()] + alt + pattern[m.end():])] \
        if m else [pattern]


def _fill(x: Any, names: dict) -> Any:
    """A template's rules with its ``$names`` filled in."""
    if isinstance(x, dict):
        return {_fill(k, names): _fill(v, names) for k, v in x.items()}
    return Template(x).safe_substitute(names) if isinstance(x, str) else [_fill(v, names) for v in x] \
        if isinstance(x, list) else x


@functools.lru_cache(maxsize=1)
def key_table() -> tuple[dict, list, dict, dict, dict]:
    """(exact verl keys, patterns by priority as (pattern, regex: group 1 the matched prefix, rule), our own keys,
    verl's defaults, {verl config name: {our key: value}}) of keys.yaml; a rule is a dict, its first item the
    action."""
    import yaml

    doc = yaml.safe_load(Path(__file__).with_name("keys.yaml").read_text(encoding="utf-8"))
    norm = lambda spec: {"map": spec} if isinstance(spec, str) else spec  # noqa: E731
    flat = {}
    for key, spec in sorted(doc["verl"].items(), key=lambda kv: "use" not in norm(kv[1])):  # templates first
        if "use" in norm(spec):
            flat.update({f"{at}.{s}": sub for k, sub in _fill(doc["templates"][spec["use"]], spec).items()
                         for at in _expand(key) for s in _expand(k)})
        else:
            flat.update({k: spec for k in _expand(key)})
    patterns = []
    for k, spec in flat.items():
        parts = k.split(".")
        deep = parts[-1] == "**" and parts[0] != "**"
        lead = next((i for i, p in enumerate(parts) if "*" in p), len(parts))
        glob = r"\.".join(re.escape(p).replace(r"\*", "[^.]*") for p in parts[parts[0] == "**":len(parts) - deep])
        head = rf"((?:[^.]+\.)*{glob})" if parts[0] == "**" else rf"({glob})(?:\..+)?" if deep else f"({glob})"
        patterns += [((parts[0] != "**", -lead, deep), k, re.compile(head), norm(spec))] * ("*" in k)
    patterns.sort(key=lambda p: p[0])
    return ({k: norm(s) for k, s in flat.items() if "*" not in k}, [p[1:] for p in patterns],
            {k: norm(s) for key, s in doc["ours"].items() for k in _expand(key)},
            {k: v for key, v in doc["verl_defaults"].items() for k in _expand(key)},
            {k: v for key, v in doc["config_names"].items() for k in _expand(key)})


@functools.lru_cache(maxsize=8192)
def rule_for(key: str, ours: bool = False) -> Optional[tuple[dict, str]]:
    """(keys.yaml rule, the key's matched prefix) for ``key`` (``ours``: among the rules of our own keys), or None."""
    exact, patterns, own, *_ = key_table()
    if ours or key in exact:
        return ((own if ours else exact)[key], key) if key in (own if ours else exact) else None
    return next(((rule, m.group(1)) for _, rx, rule in patterns if (m := rx.fullmatch(key))), None)


@functools.lru_cache(maxsize=8192)
def _in_schema(key: str) -> bool:
    return first_bad_part(split_key(key)) is None


def _ours(target: str, key: str, head: str, rule: dict) -> str:
    """The key of ours a map / prefix / same / fn rule names for ``key`` (a ``*`` target: the key's last part)."""
    if "prefix" in rule:
        return target + key[len(head):]
    return target.replace("*", key.rsplit(".", 1)[-1]) if target.endswith("*") else target


def translate_key(key: str) -> Optional[str]:
    """Our key for a verl key that is a plain rename, or our own key itself; None otherwise (used to rewrite
    ``${...}`` interpolations)."""
    if _in_schema(key):
        return key
    found = rule_for(key)
    if found is None or not {"map", "prefix"} & set(found[0]):
        return None
    ours = _ours(next(iter(found[0].values())), key, found[1], found[0])
    return ours if _in_schema(ours) else None


@dataclass
class Item:
    """One setting: ``key`` = ``value`` (Python), ``raw`` its override text (kept verbatim for a plain rename),
    ``prefix`` ``+``/``++``, ``source`` where it came from, ``parsed`` False for a sweep (only renamed)."""
    key: str
    value: Any
    raw: Optional[str] = None
    prefix: str = ""
    source: str = ""
    parsed: bool = True


@dataclass
class Translated:
    """What :func:`translate` made of the settings."""
    overrides: list = field(default_factory=list)  # override strings in our keys
    problems: list = field(default_factory=list)  # unsupported settings, one line each
    same: list = field(default_factory=list)  # (our key, value, verl key, source): must be equal after composing
    ignored: list = field(default_factory=list)  # (verl key, source, why) accepted without effect
    notes: list = field(default_factory=list)  # substitutions worth telling (vllm read as sglang)
    unknown: list = field(default_factory=list)  # a ConfigKeyError per verl-layout key that is not ours either
    origins: dict = field(default_factory=dict)  # override string -> where its setting came from
    speaks_verl: bool = False  # some setting used verl's actor_rollout_ref.* layout
    typed: dict = field(default_factory=dict)  # our key -> the verl key the user typed for it (errors name it)
    own: set = field(default_factory=set)  # our keys the user typed as ours (errors keep them)


#: the dotted keys named in a ``${...}`` interpolation
INTERP_KEYS = re.compile(r"(?<=[{:,\s])([A-Za-z_]\w*(?:\.\w+)+)(?=\s*[},])")


def _line(item: Item, key: str, value: Any = None, verbatim: bool = False) -> str:
    """The override setting our ``key``: ``++`` (add or replace) where ``key=`` / ``+key=`` would be refused (a
    dict-valued field or a key inside one, verl's ``+key`` for a key we have); verl keys in ``${...}`` rewritten."""
    from rlhf.config.objects import format_value

    if isinstance(value, str) and "${" in value:
        value = INTERP_KEYS.sub(lambda m: translate_key(m.group(1)) or m.group(1), value)
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    prefix = ("++" if item.prefix == "+" and key != item.key else item.prefix) if item.prefix else (
        "++" if (isinstance(value, dict) and is_dict_field(key)) or (parent and is_dict_field(parent)) else "")
    return f"{prefix}{key}={item.raw if verbatim and item.raw is not None else format_value(value)}"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    return a.lower() == b.lower() if isinstance(a, str) and isinstance(b, str) else a == b


def _apply(item: Item, rule: dict, head: str, out: Translated, reward_model: dict) -> None:
    """One verl setting through its rule (the rule's first item is its action)."""
    (action, arg), key, value = next(iter(rule.items())), item.key, item.value
    src = item.source if len(item.source) <= 120 else f"{item.source[:100]}...' ({len(item.source)} characters)"
    where, shown = f" ({src})" if src else "", repr(value) if len(repr(value)) <= 60 else \
        f"{repr(value)[:60]}... ({len(repr(value))} characters)"  # a chat template is thousands
    interpolated = isinstance(value, str) and "${" in value
    if any(_same(value, u) or (interpolated and u == "${...}") for u in rule.get("unset", ())):
        return  # verl's "not set": our setting stays
    if action in ("map", "prefix"):
        ours = _ours(arg, key, head, rule)
        if _in_schema(ours):
            out.overrides.append(_line(item, ours, value, verbatim=True))
            out.typed[ours] = key
        else:  # our key's unknown-key error, naming verl's
            err = unknown_key_error(ours, item.source)
            first = f"Unknown config key {key!r} (read as {ours!r}" + (f"; {item.source}" if item.source else "")
            out.unknown.append(ConfigKeyError("\n".join([first + ").", *str(err).splitlines()[1:]]), key=key,
                                              suggestions=err.suggestions, source=item.source))
    elif action in ("fn", "choose") and not item.parsed:
        out.problems.append(f"{key}: only a single value is supported here{where}.")
    elif action in ("fn", "choose"):
        try:
            to = _ours(rule.get("to") or key, key, head, rule)
            if action == "choose" and value not in arg:
                raise Unsupported(rule["why"])
            made = FUNCTIONS[arg](value, to) if action == "fn" else [(to, arg[value])] * (arg[value] is not None)
            out.overrides += [_line(item, k, v) for k, v in made]
            out.typed.update({k: key for k, _ in made if k != key and keeps_value(rule)})
        except Unsupported as e:
            out.problems.append(f"{key}={shown} is not supported{where}: {e}.")
        except (TypeError, ValueError) as e:
            out.problems.append(f"{key}={shown}: {e}{where}.")
        if key.endswith("rollout.name") and value == "vllm":
            out.notes.append(f"{key}=vllm: the rollout engine here is SGLang (same sampling settings).")
    elif action == "same" and not interpolated:
        out.same.append((_ours(arg, key, head, rule), value, key, item.source))
    elif action == "only" and not interpolated and not any(_same(value, v) for v in arg):
        accepted = ", ".join("null" if v is None else json.dumps(v) if isinstance(v, bool) else repr(v) for v in arg)
        out.problems.append(f"{key}={shown} is not supported{where}: {rule['why']} (accepted: {accepted}).")
    elif action == "refuse":
        out.problems.append(f"{key}={shown} is not supported{where}: {arg}.")
    elif action == "ignore":
        out.ignored.append((key, item.source, arg))
    elif action == "reward_model":
        reward_model[arg] = (value, item)


def _reward_model_source(reward_model: dict, out: Translated) -> None:
    """verl's reward_model.enable + model.path -> one model source in reward.sources."""
    if reward_model.get("enable", (None,))[0] is not True:
        return
    path, item = reward_model.get("path", (None, None))
    if not path or "${" in str(path):
        out.problems.append("reward_model.enable=True needs reward_model.model.path=<HF reward model>.")
        return
    source = {"type": "model", "path": path, "weight": 1.0, **{name: reward_model[name][0] for name in (
        "micro_batch_size", "max_length") if reward_model.get(name, (None,))[0] is not None and "${" not in str(
        reward_model[name][0])}}
    out.overrides.append(_line(item, "reward.sources", [source]))


def _contradiction(line: str, item: Item, setters: dict, out: Translated) -> None:
    """Two keys typed on the command line (a verl key and ours, e.g. actor_rollout_ref.hybrid_engine=False and
    rollout.mode=colocated) that set one key of ours to different values: a problem naming both.  A command-line
    setting over a config file's is an override; verl's own files repeat settings under old and new names."""
    try:
        ours, value = line.lstrip("+").split("=", 1)[0], _parser().parse_overrides([line])[0].value()
    except Exception:  # noqa: BLE001 - a sweep: composing reads it
        return
    if isinstance(value, str) and "${" in value:
        return  # an interpolation: the value it names is checked where that is set
    prev = setters.setdefault(ours, (item, value))
    typed_here = all(it.source.startswith("command-line") for it in (prev[0], item))
    if typed_here and prev[0].key != item.key and not _same(prev[1], value):
        typed = [f"{it.key.lstrip('+')}={it.raw if it.raw is not None else it.value}" for it in (prev[0], item)]
        out.problems.append(f"{typed[0]} and {typed[1]} contradict each other: they set {ours} to {prev[1]!r} and "
                            f"{value!r}; drop one of them.")


@functools.lru_cache(maxsize=1)
def _parser():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def translate(overrides: Sequence[str], file_items: Sequence[Item] = ()) -> Translated:
    """The preprocessing step: a config file's settings (``file_items``, :mod:`rlhf.config.config_file`), then
    ``overrides``, as override strings of our schema.

    A key given more than once counts at its last occurrence (the command line wins over a config file); a config
    file's value equal to verl's default for a key of keys.yaml ``verl_defaults`` is skipped (it reads as "not set").
    Keys that are neither ours nor verl's stay as they are, so composing reports them with the nearest valid keys.
    Group choices (``recipe=``, ``+algorithm=``), ``hydra.*``, deletions, package overrides and lines Hydra cannot
    parse pass through; ``hydra.run.dir=DIR`` also sets ``trainer.default_local_dir=DIR`` unless that is given too."""
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException

    items, passthrough, parser = list(file_items), [], _parser()
    for line in overrides:
        try:
            ov = parser.parse_overrides([line])[0]
        except HydraException:
            ov = None
        if ov is None or ov.is_delete() or ov.package is not None:
            passthrough.append(line)
            continue
        raw, single = line.split("=", 1)[1] if "=" in line else "", ov.value_type == ValueType.ELEMENT
        items.append(Item(ov.key_or_group, ov.value() if single else raw, raw, "++" if line.startswith("++") else
                          "+" * line.startswith("+"), f"command-line override {line!r}", single))
    out, reward_model, defaults, setters = Translated(), {}, key_table()[3], {}
    last = {item.key: i for i, item in enumerate(items)}
    for i, item in enumerate(items):
        key = item.key
        if last[key] != i or (item.source.startswith("config file") and any(
                item.value == v and type(item.value) is type(v) for v in defaults.get(key, ()))):
            continue  # given again later, or verl's default (not chosen by the user): our setting stays
        before = len(out.overrides)
        out.speaks_verl |= key.lstrip("+").startswith("actor_rollout_ref.")
        passthrough_key = key in ("recipe", "algorithm") or key.split(".")[0] == "hydra"
        found = None if passthrough_key else rule_for(key, ours=True) or (None if _in_schema(key) else rule_for(key))
        if found is None:  # ours, or neither ours nor verl's: composing reports it with the nearest keys
            out.overrides.append(_line(item, key, item.value, verbatim=True))
            out.own.add(key.lstrip("+"))
        else:
            _apply(item, *found, out, reward_model)
        for line in out.overrides[before:]:
            out.origins.setdefault(line, item.source)
            _contradiction(line, item, setters, out)
    _reward_model_source(reward_model, out)
    out.overrides = [o[1:] if o.startswith(("+recipe=", "+algorithm=")) else o for o in out.overrides + passthrough]
    keys = {o.split("=", 1)[0].lstrip("+"): o.split("=", 1)[1] for o in out.overrides if "=" in o}
    if "hydra.run.dir" in keys and "trainer.default_local_dir" not in keys:
        out.overrides.append(f"trainer.default_local_dir={keys['hydra.run.dir']}")
    return out


def after_compose(cfg: Any, t: Translated) -> tuple[list[str], list[str]]:
    """What the translation leaves for the composed config: ``rollout.num_engines`` where no setting gives it (verl's
    rollout pool, :func:`_engine_count`), the ``same`` constraints it breaks (the reference's / critic's layout is the
    actor's) and the lines to tell the user (substitutions, settings without effect, reward models on the CPU)."""
    from omegaconf import OmegaConf

    if not any(o.lstrip("+").startswith("rollout.num_engines=") for o in t.overrides):
        _engine_count(cfg, t)
    problems = [f"{verl_key}={value!r} is not supported" + (f" ({source})" if source else "") + f": the reference "
                f"model and the critic use the actor's layout, {ours}={OmegaConf.select(cfg, ours)!r}; set "
                f"{ours}={value!r} (actor_rollout_ref.actor.megatron.*) or drop {verl_key}."
                for ours, value, verl_key, source in t.same if not _same(OmegaConf.select(cfg, ours), value)]
    return problems, t.notes + ignored_lines(t.ignored) + _reward_model_lines(cfg, t)


def _engine_count(cfg: Any, t: Translated) -> None:
    """verl's rollout pool (``rollout.nnodes x rollout.n_gpus_per_node``, one-step-off recipes) sets the engine count
    (:func:`rlhf.rollout.placement.pool_engines`); else settings in verl's layout for a colocated job of
    ``trainer.n_gpus_per_node`` GPUs get verl's replica count (one per ``rollout.tensor_model_parallel_size`` GPUs of
    ``trainer.nnodes x trainer.n_gpus_per_node``: 2 nodes x 8 GPUs at TP 4 run 4), or the most engines below it that
    this job places (rlhf/rollout/placement.py), with a warning naming both counts."""
    from rlhf.rollout.placement import placement_problems, pool_engines

    r, tr = cfg.rollout, cfg.trainer
    tp, nodes = r.tensor_model_parallel_size, r.nnodes or 1
    if (r.n_gpus_per_node or 0) >= 1 and tp >= 1 and nodes >= 1 and r.n_gpus_per_node % tp == 0:
        r.num_engines = pool_engines(nodes, r.n_gpus_per_node, tp)  # a different count: rlhf.config.validate
        return
    if not t.speaks_verl or r.mode != "colocated" or r.num_engines != 1 or not tr.n_gpus_per_node or tp < 1:
        return
    engines = max(1, (tr.nnodes or 1) * tr.n_gpus_per_node // tp)
    for n in [*range(engines, 0, -1), engines]:  # none places: the check names verl's count
        r.num_engines = n
        if not placement_problems(cfg):
            break
    if r.num_engines != engines:
        logging.getLogger("rlhf.config").warning(
            "rlhf.config: verl would run %d rollout replicas here; this job places %d colocated engine(s) of TP %d "
            "(set rollout.num_engines to choose, or rollout.mode=disaggregated)", engines, r.num_engines, tp)


def _reward_model_lines(cfg: Any, t: Translated) -> list[str]:
    """One loud line per reward model (``reward.sources`` of type model, verl's ``reward_model.enable``): where it
    scores and why not on GPUs as verl would serve it, naming verl's GPU settings given for it (no effect here)."""
    gpu = ("reward_model.rollout.", "reward_model.megatron.", "reward_model.n_gpus_per_node", "reward_model.nnodes",
           "reward.reward_model.rollout.")
    gpu_keys = sorted({k for k, _, _ in t.ignored if k.startswith(gpu) and not k.endswith("_target_")})
    given = (f"; verl would serve it on GPUs ({', '.join(gpu_keys[:4])}{', ...' if len(gpu_keys) > 4 else ''} "
             f"given: no effect here)") if gpu_keys else "; verl would serve it on GPUs"
    return [f"REWARD MODEL ON CPU: reward.sources[{i}] (the reward model {s.path}) scores on the CPU, "
            f"{'in a Ray worker of its own' if s.placement == 'ray' else 'in-process on rank 0'}, not on GPUs: a "
            f"reward model on GPUs is neither placed nor in the memory plan here{given}.  Expect slow scoring for a "
            f"large model, or serve it outside this job and score through custom_reward_function.path."
            for i, s in enumerate(cfg.reward.sources) if s.type == "model"]


def ignored_lines(ignored: Sequence[tuple]) -> list[str]:
    """Warning lines naming the verl settings accepted without effect, so none passes silently: command-line keys
    with the reason; a config file's keys in one line per file, by section, deeper keys as ``name.*`` (a verl
    ppo_trainer.yaml holds hundreds of engine / worker details).  verl's ``_target_`` names and ``hydra.*`` are
    left out (they configure nothing)."""
    by_why, by_file = {}, {}
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

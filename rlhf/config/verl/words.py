"""Config errors in the user's words: where the user wrote verl's keys, every problem line names the key as typed
(``actor_rollout_ref.actor.megatron.tensor_model_parallel_size``, not ``parallel.tensor_model_parallel_size``) and
its fix in verl's keys, our engine count (``rollout.num_engines``, which verl has not) as verl's rollout replicas.
The keys typed come from the translation (:attr:`~rlhf.config.verl.compat.Translated.typed`), the other keys of ours
from keys.yaml read backwards (a verl key that translates back to the same key of ours)."""
from __future__ import annotations

import functools
import re
from typing import Optional

from rlhf.config.verl.compat import Translated, _ours, key_table, keeps_value, translate_key

_KEY = re.compile(r"(?<![\w.\-/'])([A-Za-z_]\w*(?:\.\w+)+)(?![\w(])")
_ENGINES = "rollout.num_engines"


@functools.lru_cache(maxsize=1)
def _reverse() -> tuple[dict, list]:
    """({our key: [verl keys]} of keys.yaml's exact renames and value rewrites, [(verl prefix, our prefix)] of its
    prefix rules)."""
    from rlhf.config.keys import schema_node

    exact, patterns, *_ = key_table()
    renames: dict = {}
    for key, rule in exact.items():
        if "map" in rule or (keeps_value(rule) and rule.get("to")):
            ours = _ours(rule.get("map") or rule["to"], key, key, rule)
            if schema_node(ours.split(".")) is None:  # a leaf, not a section (betas -> actor.optim)
                renames.setdefault(ours, []).append(key)
    prefixes = [(k[:-3], rule["prefix"]) for k, _, rule in patterns
                if k.endswith(".**") and "prefix" in rule and "*" not in k[:-3]]
    return renames, prefixes


@functools.lru_cache(maxsize=4096)
def verl_key_for(ours: str) -> Optional[str]:
    """verl's key for our key ``ours`` (one that translates back to it; the shortest, verl's actor_rollout_ref.*
    layout first, override_*_config fields last), None when verl names it the same or has no such key.  E.g.
    ``parallel.sequence_parallel`` -> ``actor_rollout_ref.actor.megatron.sequence_parallel``."""
    renames, prefixes = _reverse()
    by_prefix = [v + ours[len(o):] for v, o in prefixes if ours.startswith(o + ".")]
    fields = [c for c in renames.get(ours, []) if "override_" in c]  # override_*_config.<field>: the long way
    plain = [c for c in renames.get(ours, []) if c not in fields and c not in key_table()[3]]  # not verl's FSDP-only
    if not plain and ours in by_prefix:  # verl's key is ours (critic.optim.lr)
        return None
    rank = lambda c: (not c.startswith("actor_rollout_ref."), len(c), c)  # noqa: E731
    return min(plain, key=rank, default=None) or min(
        [c for c in by_prefix if translate_key(c) == ours] + fields, key=lambda c: ("override_" in c, *rank(c)),
        default=None)


def _engines(text: str, t: Translated) -> str:
    """Our engine count as verl's rollout replicas (verl runs trainer.nnodes x trainer.n_gpus_per_node /
    rollout TP of them; it has no count of its own)."""
    text = re.sub(r"rollout\.mode=(\w+) with rollout\.num_engines=(\d+) x ", r"\2 rollout replica(s) (\1) x ", text)
    tp = t.typed.get("rollout.tensor_model_parallel_size", "actor_rollout_ref.rollout.tensor_model_parallel_size")
    how = (f"raise {tp} (verl runs trainer.nnodes x trainer.n_gpus_per_node / {tp} replicas), or lower "
           f"trainer.n_gpus_per_node")
    text = re.sub(r"lower rollout\.num_engines to (\d+)( and rollout\.tensor_model_parallel_size)? or less",
                  lambda m: f"run at most {m[1]} rollout replica(s): {how}", text)
    text = text.replace("lower rollout.num_engines or rollout.tensor_model_parallel_size",
                        "lower rollout.tensor_model_parallel_size or trainer.n_gpus_per_node")
    text = re.sub(r"(lower|raise|set) rollout\.num_engines\b", lambda m: f"{m[1]} the rollout replicas ({how})",
                  text)
    text = re.sub(r"rollout\.num_engines=(\d+) engines of TP", r"\1 rollout replicas of TP", text)
    return re.sub(r"rollout\.num_engines=(\d+)", r"\1 rollout replica(s)", text)


def in_user_words(text: str, t: Optional[Translated]) -> str:
    """``text`` (a config error) with our keys as the user's verl keys: each key the user typed in verl's layout
    as typed, and where the user spoke verl (``actor_rollout_ref.*``) every other key of ours that verl names
    otherwise; keys the user typed as ours stay.  Unchanged for a user of our keys."""
    if t is None or not (t.typed or t.speaks_verl):
        return text
    if t.speaks_verl and _ENGINES not in t.own:
        text = _engines(text, t)

    def word(m: re.Match) -> str:
        key = m.group(1)
        if key in t.own:
            return key
        return t.typed.get(key) or (verl_key_for(key) if t.speaks_verl else None) or key

    return _KEY.sub(word, text)

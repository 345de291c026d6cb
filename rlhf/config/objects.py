"""What Python hands the config and takes from it.  In-process objects referenced by ``object://<kind>/<id>`` URIs: what
a Python user hands to :class:`rlhf.Trainer` with no YAML form (a reward function, a ``datasets.Dataset`` or list of
row dicts, a tokenizer) is registered here, the config holds its URI and the trainer's builders call
:func:`get_object`.  They live in this process only (a job started from a command line cannot see them; validation
says so).  Kinds: ``reward`` (``fn(data_source, solution_str, ground_truth, extra_info=None) -> float``),
``dataset``, ``tokenizer``.
Python values as Hydra override strings (:func:`format_value`: rlhf.Trainer's arguments, the verl layer's rewrites).
``<trainer.default_local_dir>/config.yaml`` (:func:`write_run_config`): the composed config of a run, written at its
start by ``python -m rlhf.main`` and ``rlhf.Trainer.run`` (global rank 0), so the run's outputs say what was trained
(``scripts/convert_checkpoint.py mcore-to-hf --ckpt`` reads the model reference from it)."""
from __future__ import annotations

import itertools
import os
import re
import threading
from typing import Any

OBJECT_SCHEME, OBJECT_KINDS = "object://", ("reward", "dataset", "tokenizer")
RUN_CONFIG = "config.yaml"
_objects: dict[str, Any] = {}
_ids, _lock = itertools.count(), threading.Lock()


def is_object_ref(value: Any) -> bool:
    """True for a string ``object://...``."""
    return isinstance(value, str) and value.startswith(OBJECT_SCHEME)


def register_object(obj: Any, kind: str) -> str:
    """Keep ``obj`` for this process and return its URI ``object://<kind>/<n>`` (the same URI for the same object).
    Raises ValueError: ``kind`` is not one of :data:`OBJECT_KINDS`."""
    if kind not in OBJECT_KINDS:
        raise ValueError(f"register_object: kind={kind!r} is not one of {OBJECT_KINDS}")
    with _lock:
        uri = next((u for u, known in _objects.items() if known is obj and u.startswith(f"{OBJECT_SCHEME}{kind}/")),
                   None) or f"{OBJECT_SCHEME}{kind}/{next(_ids)}"
        _objects[uri] = obj
    return uri


def get_object(uri: str) -> Any:
    """The object registered under ``uri``.  Raises KeyError: none in this process (a config of another process)."""
    if uri not in _objects:
        raise KeyError(f"{uri} is not an object of this process; in-process objects (rlhf.Trainer's reward "
                       f"callables, datasets, tokenizers) exist only in the Python process that created the Trainer")
    return _objects[uri]


def unknown_objects(values: Any) -> list[str]:
    """The ``object://`` strings among ``values`` (a string or a list) that are not registered here."""
    return [v for v in ([values] if isinstance(values, str) else list(values or [])) if is_object_ref(v)
            and v not in _objects]


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
    if re.fullmatch(r"[A-Za-z0-9_./:@+-]+", s):  # a plain token (paths, hub names) that Hydra reads back as is
        from hydra.core.override_parser.overrides_parser import OverridesParser

        try:
            if OverridesParser.create().parse_overrides([f"k={s}"])[0].value() == s:
                return s
        except Exception:  # noqa: BLE001 - quoted below
            pass
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def write_run_config(cfg) -> str:
    """Write the composed config to ``<trainer.default_local_dir>/config.yaml`` (tmp + rename); returns the path."""
    from omegaconf import OmegaConf

    os.makedirs(cfg.trainer.default_local_dir, exist_ok=True)
    path = os.path.join(cfg.trainer.default_local_dir, RUN_CONFIG)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(OmegaConf.to_yaml(cfg, resolve=True))
    os.replace(path + ".tmp", path)
    return path

"""In-process objects referenced from the config by ``object://<kind>/<id>`` URIs: what a Python user hands to
:class:`rlhf.Trainer` that has no YAML form (a reward function object, a ``datasets.Dataset`` or list of row dicts, a
tokenizer object) is registered here and the config holds its URI; the trainer's builders call :func:`get_object`.
They live in this process only (a job started from a command line cannot see them; validation says so).  Kinds:
``reward`` (``fn(data_source, solution_str, ground_truth, extra_info=None) -> float``), ``dataset``, ``tokenizer``.
"""
from __future__ import annotations

import itertools
import threading
from typing import Any

__all__ = ["OBJECT_SCHEME", "OBJECT_KINDS", "register_object", "get_object", "is_object_ref", "unknown_objects"]

OBJECT_SCHEME = "object://"
OBJECT_KINDS = ("reward", "dataset", "tokenizer")
_objects: dict[str, Any] = {}
_ids = itertools.count()
_lock = threading.Lock()


def is_object_ref(value: Any) -> bool:
    """True for a string ``object://...``."""
    return isinstance(value, str) and value.startswith(OBJECT_SCHEME)


def register_object(obj: Any, kind: str) -> str:
    """Keep ``obj`` for this process and return its URI ``object://<kind>/<n>``.  Registering the same object
    twice gives the same URI.

    Raises:
        ValueError: ``kind`` is not one of :data:`OBJECT_KINDS`.
    """
    if kind not in OBJECT_KINDS:
        raise ValueError(f"register_object: kind={kind!r} is not one of {OBJECT_KINDS}")
    with _lock:
        for uri, known in _objects.items():
            if known is obj and uri.startswith(f"{OBJECT_SCHEME}{kind}/"):
                return uri
        uri = f"{OBJECT_SCHEME}{kind}/{next(_ids)}"
        _objects[uri] = obj
    return uri


def get_object(uri: str) -> Any:
    """The object registered under ``uri``.

    Raises:
        KeyError: no such object in this process (e.g. the config came from another process).
    """
    try:
        return _objects[uri]
    except KeyError:
        raise KeyError(f"{uri} is not an object of this process; in-process objects (rlhf.Trainer's reward "
                       f"callables, datasets, tokenizers) exist only in the Python process that created the "
                       f"Trainer") from None


def unknown_objects(values: Any) -> list[str]:
    """The ``object://`` strings among ``values`` (a string or a list) that are not registered here."""
    items = [values] if isinstance(values, str) else list(values or [])
    return [v for v in items if is_object_ref(v) and v not in _objects]

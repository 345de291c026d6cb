"""In-process objects referenced from the config by ``object://<kind>/<id>`` URIs: what a Python user hands to
:class:`rlhf.Trainer` with no YAML form (a reward function, a ``datasets.Dataset`` or list of row dicts, a tokenizer)
is registered here, the config holds its URI and the trainer's builders call :func:`get_object`.  They live in this
process only (a job started from a command line cannot see them; validation says so).  Kinds: ``reward``
(``fn(data_source, solution_str, ground_truth, extra_info=None) -> float``), ``dataset``, ``tokenizer``."""
from __future__ import annotations

import itertools
import threading
from typing import Any

OBJECT_SCHEME, OBJECT_KINDS = "object://", ("reward", "dataset", "tokenizer")
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

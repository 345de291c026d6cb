"""Run a patch on an SGLang module once it is imported (at once when it already is).

The stand-in package is imported by every SGLang process of a CPU engine (scheduler ranks included), usually
before SGLang imports the modules patched here; the CPU-only corrections of those modules are applied from here.
Three cases: the module is not imported yet (its loader is wrapped to patch right after it ran); it is imported
(patched now); it is being imported -- the stand-in's own import happens inside it (e.g. ``sampler`` imports
``memory_pool``, which imports ``sgl_kernel``) and its functions are not defined yet -- then the patch runs at the
next import of any module once it finished (every later import passes through the finder below).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable, Dict, List

_PATCHES: Dict[str, List[Callable]] = {}  # not imported yet: patched right after their first import
_DEFERRED: Dict[str, List[Callable]] = {}  # being imported: patched once they finished


def _initializing(module) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _apply_deferred() -> None:
    for target in [t for t, m in ((t, sys.modules.get(t)) for t in _DEFERRED) if m is not None and
                   not _initializing(m)]:
        for patch in _DEFERRED.pop(target):
            patch(sys.modules[target])


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Wraps the loader of each module named in ``_PATCHES`` so its patches run after it executed; applies the
    deferred patches of modules that finished importing meanwhile."""

    def find_spec(self, name, path=None, target=None):
        if _DEFERRED:
            _apply_deferred()
        if name not in _PATCHES:
            return None
        sys.meta_path.remove(self)  # let the other finders find the real module
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            for patch in _PATCHES.pop(name, []):
                patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def after_import(target: str, patch: Callable) -> None:
    """Call ``patch(module)`` for the module named ``target`` once it is imported (see the module docstring).
    ``patch`` must be idempotent."""
    module = sys.modules.get(target)
    if module is not None and not _initializing(module):
        patch(module)
        return
    pending = _DEFERRED if module is not None else _PATCHES
    if patch not in pending.setdefault(target, []):
        pending[target].append(patch)
    if not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())

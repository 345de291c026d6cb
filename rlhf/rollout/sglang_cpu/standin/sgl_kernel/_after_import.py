"""Run a patch on an SGLang module right after it is first imported (or at once when it already is).

The stand-in package is imported by every SGLang process of a CPU engine (scheduler ranks included) before
SGLang imports its attention backends, so the CPU-only corrections of those backends are applied from here.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable, Dict, List

_PATCHES: Dict[str, List[Callable]] = {}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Wraps the loader of each module named in ``_PATCHES`` so its patches run after it executed."""

    def find_spec(self, name, path=None, target=None):
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
            for patch in _PATCHES[name]:
                patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def after_import(target: str, patch: Callable) -> None:
    """Call ``patch(module)`` for the module named ``target``: now when it is imported already, else right
    after its first import.  ``patch`` must be idempotent."""
    if target in sys.modules:
        patch(sys.modules[target])
        return
    _PATCHES.setdefault(target, [])
    if patch not in _PATCHES[target]:
        _PATCHES[target].append(patch)
    if not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())

"""Tiny random Hugging Face causal LMs built locally (no downloads) for tests and demos.

Thin re-export of :mod:`rlhf.quickstart.tiny` (the product code).
"""
from __future__ import annotations

from rlhf.quickstart.tiny import TINY_CONFIGS, build_tiny_hf_model, make_tiny_hf_model  # noqa: F401

__all__ = ["TINY_CONFIGS", "make_tiny_hf_model", "build_tiny_hf_model"]

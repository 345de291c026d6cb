"""Test double of the converter's checkpoint reader over an in-memory HF state dict."""
from __future__ import annotations


class StateDictReader:
    """HFCheckpointReader's interface (``path``, ``shape``, ``get`` with row / column index selections) over a state
    dict ``{HF name: tensor}``, for ``parallel.convert.local_shard_from_hf``."""

    path = "<state dict>"

    def __init__(self, hf):
        self.hf = hf

    def shape(self, name):
        return list(self.hf[name].shape)

    def get(self, name, rows=None, cols=None):
        t = self.hf[name]
        t = t if rows is None else t[rows]
        return t if cols is None else t[:, cols]

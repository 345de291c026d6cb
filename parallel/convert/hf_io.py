"""Hugging Face safetensors checkpoints, read through `safetensors.safe_open` (headers and slices).

* `HFCheckpointReader`: lazy, per-tensor slice reads for import (a rank reads only its shard).
* `read_checkpoint_metadata`: {HF name: (shape, dtype)} from the headers alone, no tensor data.

Both accept a single ``model.safetensors`` or a sharded checkpoint with
``model.safetensors.index.json``; without an index, every ``*.safetensors`` file in the directory
is read.
"""
from __future__ import annotations

import json
import os
from contextlib import ExitStack

import torch

INDEX_FILE = "model.safetensors.index.json"


def _weight_files(path: str) -> dict[str, str] | None:
    """{tensor name: file} from the index, or None when there is no index (names come from headers).

    Raises FileNotFoundError when the directory holds no safetensors checkpoint.
    """
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            return json.load(f)["weight_map"]
    if not os.path.isdir(path) or not any(f.endswith(".safetensors") for f in os.listdir(path)):
        raise FileNotFoundError(f"no model.safetensors or {INDEX_FILE} in {path!r}; "
                                f"convert .bin checkpoints to safetensors first")
    return None


class HFCheckpointReader:
    """Lazy reader of a HF safetensors checkpoint (single file, several files, or sharded with an index).

    `get(name, rows=None, cols=None)` reads only the requested slice (a CPU tensor in the
    checkpoint's dtype); `shape(name)` and `dtype(name)` read headers only.  Use as a context
    manager or call `close()`.  Raises FileNotFoundError when the directory holds no safetensors,
    KeyError naming a missing tensor.
    """

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        self._safe_open = safe_open
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}
        weight_map = _weight_files(path)
        if weight_map is None:
            weight_map = {}
            for fname in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
                for name in self._open(fname).keys():
                    weight_map[name] = fname
        self.weight_map = weight_map

    def _open(self, fname: str):
        if fname not in self._handles:
            self._handles[fname] = self._stack.enter_context(self._safe_open(os.path.join(self.path, fname), "pt"))
        return self._handles[fname]

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _slice(self, name: str):
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} is missing from the Hugging Face checkpoint at {self.path!r}")
        return self._open(self.weight_map[name]).get_slice(name)

    def shape(self, name: str) -> list[int]:
        return list(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        st = self._slice(name).get_dtype()
        if st not in _DTYPES:
            raise KeyError(f"tensor {name!r} in {self.path!r} has safetensors dtype {st!r}, which has no torch "
                           f"equivalent here; supported: {sorted(_DTYPES)}")
        return _DTYPES[st]

    def get(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        sl = self._slice(name)
        if rows is None and cols is None:
            return sl[:]
        if cols is None:
            return sl[rows]
        return sl[rows if rows is not None else slice(None), cols]

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def read_checkpoint_metadata(model_path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Names, shapes and dtypes of all tensors in a HF checkpoint's safetensors files (headers only).

    Args:
        model_path: a HF model directory with ``model.safetensors``, several ``*.safetensors``
            files, or a ``model.safetensors.index.json`` and its shards.
    Returns:
        ``{hf_name: (shape tuple, torch.dtype)}``.
    Raises:
        FileNotFoundError: no safetensors checkpoint in ``model_path``.
        KeyError: a safetensors dtype torch has no equivalent for.
    """
    with HFCheckpointReader(model_path) as reader:
        return {name: (tuple(reader.shape(name)), reader.dtype(name)) for name in reader.weight_map}

"""Check mode: read sent tensors back from the engines and compare them exactly.

SGLang's ``get_weights_by_name`` returns the first rows of a weight as engine TP rank 0 holds it (rank 0's leading
rows of a column-parallel weight, gathered rows of o_proj/down_proj, full norms), compared exactly with the same
rows of what was sent.  Weights it cannot read back (k/v under KV-head replication, models without the method)
are reported as unverifiable.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch

from rlhf.weight_bridge.bucketing import BucketPlan, bucket_views

__all__ = ["CheckReport", "sample_rows", "verify"]


@dataclass
class CheckReport:
    """Which sent tensors were read back (``"engine<i>:<name>"``) and agreed, differed (max abs diff), or
    could not be read back (reason)."""

    verified: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, float]] = field(default_factory=list)
    unverifiable: list[tuple[str, str]] = field(default_factory=list)


def sample_rows(bplan: BucketPlan, buf: torch.Tensor, names: set, rows: int, out: dict) -> None:
    """Copy the first ``rows`` rows (fp32, CPU) of every tensor of bucket ``bplan`` named in ``names`` into ``out``."""
    for name, view in bucket_views(buf, bplan):
        if name in names:
            part = view.reshape(view.shape[0], -1)[:rows] if view.dim() > 1 else view[:rows]
            out[name] = part.detach().to("cpu", torch.float32).clone()


def verify(engines, names: list[str], sent: Mapping[str, torch.Tensor], rows: int) -> CheckReport:
    """Read ``names`` back from every engine (``get_weights_by_name``) and compare with ``sent``."""
    rep = CheckReport()
    for name in names:
        try:
            got_all = engines.get_weights_by_name(name, truncate_size=rows)
        except Exception as e:  # noqa: BLE001 - reported, not raised
            rep.unverifiable.append((name, f"{type(e).__name__}: {e}"))
            continue
        for i, got in enumerate(got_all):
            label, want = f"engine{i}:{name}", sent.get(name)
            if want is None or got is None:
                rep.unverifiable.append((label, "not sampled" if want is None else "engine returned None"))
                continue
            got = torch.as_tensor(got, dtype=torch.float32)
            if got.numel() == 0:
                rep.unverifiable.append((label, "engine returned 0 rows (e.g. k/v under KV-head replication)"))
                continue
            got = got.reshape(got.shape[0], -1) if want.dim() > 1 else got.reshape(-1)
            n = min(got.shape[0], want.shape[0])
            if got.shape[1:] != want.shape[1:] or n == 0:
                rep.mismatched.append((label, float("inf")))
                continue
            diff = (got[:n] - want[:n]).abs().max().item()
            (rep.verified.append(label) if diff == 0.0 else rep.mismatched.append((label, diff)))
    return rep

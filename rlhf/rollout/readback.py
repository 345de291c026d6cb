"""Read weights back from the rollout engines and compare them with what a weight sync sent (the sync's check mode,
rlhf.weight_bridge: ``WeightSyncConfig.check``).  Only the fleet's ``get_weights_by_name`` is used."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch

__all__ = ["CheckReport", "verify"]


@dataclass
class CheckReport:
    """Sent tensors read back (``"engine<i>:<name>"``): agreed, differed (max abs diff), unverifiable (reason)."""

    verified: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, float]] = field(default_factory=list)
    unverifiable: list[tuple[str, str]] = field(default_factory=list)


def verify(engines, names: list[str], sent: Mapping[str, torch.Tensor], rows: int) -> CheckReport:
    """Read ``names`` back from every engine and compare them exactly with ``sent``: SGLang's ``get_weights_by_name``
    returns the first ``rows`` rows as engine TP rank 0 holds them (rank 0's leading rows of a column-parallel weight,
    gathered rows of o_proj/down_proj, full norms); what it cannot read back (k/v under KV-head replication, models
    without the method) is unverifiable."""
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

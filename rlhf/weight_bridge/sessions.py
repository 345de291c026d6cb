"""The engines' weight-update sessions around one sync (controller only): SGLang >= 0.5.23 loads weights only
between ``begin_weight_update`` and ``end_weight_update``; the fleet's ``begin_sync`` token tells which engines were
replaced meanwhile (a replaced engine has no session and serves its checkpoint until a sync reaches it)."""
from __future__ import annotations

import time

from rlhf.weight_bridge.plan import WeightBridgeError

__all__ = ["open_sessions", "close_sessions"]


def open_sessions(engines, targets: list[int]) -> tuple:
    """``engines.begin_sync()``, then every target's ``begin_weight_update``; ``(token, error or None, seconds
    waited)``.  On an error the sessions are closed again, except when ``begin_sync`` refuses (a generate in
    progress: nothing opened, and a close would queue behind it on the one-call-at-a-time actor).  A target replaced
    while its session opened is an error too: the new engine has no session and would never join a broadcast."""
    try:
        token = engines.begin_sync()
    except Exception as e:  # noqa: BLE001
        return None, WeightBridgeError(f"begin_sync refused: {type(e).__name__}: {e}"), 0.0
    t0 = time.perf_counter()
    try:
        engines.wait(engines.start_weight_update(engines=targets), "begin_weight_update")
        replaced = [i for i in engines.replaced_since(token) if i in targets]
    except Exception as e:  # noqa: BLE001
        close_sessions(engines, targets)
        return token, WeightBridgeError(f"begin_weight_update failed: {type(e).__name__}: {e}"), 0.0
    waited = time.perf_counter() - t0
    if replaced:
        close_sessions(engines, targets)
        return token, WeightBridgeError(f"engine(s) {replaced} replaced while opening the weight-update sessions; "
                                        f"nothing was sent: sync again"), waited
    return token, None, waited


def close_sessions(engines, targets: list[int]) -> None:
    """Close the sessions of a sync that will not write (errors ignored: the sync already fails); also after a begin
    failed on one engine: each actor runs one call at a time, in submission order (``max_concurrency=1``), so every
    engine runs this end after its begin."""
    try:
        engines.end_weight_update(engines=targets)
    except Exception:  # noqa: BLE001
        pass

"""The engines' weight-update sessions around one sync (controller only).

SGLang >= 0.5.23 loads weights only between ``begin_weight_update`` and ``end_weight_update``.  A sync opens a
session on every target engine before anything is sent and closes it after the last bucket; the fleet's
``begin_sync`` token tells which engines were replaced meanwhile (a replaced engine has no session and serves its
checkpoint's weights until a sync reaches it).
"""
from __future__ import annotations

import time

from rlhf.weight_bridge.validate import WeightBridgeError

__all__ = ["open_sessions", "close_sessions"]


def open_sessions(engines, targets: list[int]) -> tuple:
    """``engines.begin_sync()`` then every target's ``begin_weight_update``; returns ``(token, error or None,
    seconds waited for the begins)``.

    On an error every target's session is closed again, except when ``begin_sync`` itself refuses (a generate in
    progress: no session was opened, and a close would queue behind that generate on the one-call-at-a-time engine
    actor).  A target engine replaced while its session opened (the manager's ``wait`` replaces a dead engine and
    returns None) is an error too: the new engine has no session, was validated against nothing, and with the
    distributed transport never joined the group, where a broadcast would wait for it until the group's timeout.
    """
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
    """Close the sessions of a sync that will not write (errors ignored: the sync already fails).

    Also right after a ``begin_weight_update`` that failed on one engine (``wait`` raised there and did not collect
    the others): each engine actor runs one call at a time, in the order this caller submitted them (Ray actors with
    ``max_concurrency=1``, rlhf/rollout/placement.py), so every engine runs this end after its begin."""
    try:
        engines.end_weight_update(engines=targets)
    except Exception:  # noqa: BLE001
        pass

"""Wait until a Ray cluster has every expected node alive; exit 1 with one clear line if it does not.

    python recipes/_launch/ray_wait.py --address 10.0.0.1:20370 --nodes n1 n2 --timeout 300 [--watch-pid PID]

``--nodes`` are the Ray node names (``ray start --node-name``; the Slurm node names in the recipes' Slurm
body), or a single integer count.  ``--watch-pid`` is the local ``ray start --block`` process: when it
dies the wait fails at once instead of running into the timeout.  Exit codes: 0 all joined, 1 not.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time


def _port_open(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


def _alive(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def wait_for_nodes(address: str, expected: list[str] | int, timeout: float, watch_pid: int | None = None,
                   poll_s: float = 1.0) -> tuple[bool, str]:
    """Poll ``ray.nodes()`` until all expected nodes are alive.  Returns (ok, message)."""
    count = expected if isinstance(expected, int) else len(expected)
    names = [] if isinstance(expected, int) else list(expected)
    start = time.time()
    deadline = start + timeout
    while not _port_open(address):
        if not _alive(watch_pid):
            return False, f"the Ray head at {address} did not start (its `ray start` exited; see the [ray ...] lines)"
        if time.time() > deadline:
            return False, f"no Ray head listening at {address} after {timeout:.0f} s"
        time.sleep(poll_s)
    import ray

    while True:  # the head may still be starting (or starting again after `ray start` gave up: slurm_task.sh)
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
            break
        except Exception as e:  # noqa: BLE001 - ConnectionError / RpcError / RuntimeError, by Ray version
            ray.shutdown()
            if not _alive(watch_pid) or time.time() > deadline:
                return False, f"cannot connect to the Ray head at {address}: {type(e).__name__}: {e}"
            time.sleep(max(poll_s, 2.0))
    try:
        up: list[str] = []
        while True:
            up = sorted(n.get("NodeName", "?") for n in ray.nodes() if n.get("Alive"))
            have = sum(1 for n in names if n in up) if names else len(up)
            if have >= count:
                return True, f"Ray: {len(up)}/{count} nodes up ({', '.join(up)}) after {time.time() - start:.0f} s"
            if not _alive(watch_pid):
                return False, f"this node's Ray exited while waiting for the others (up: {', '.join(up)})"
            if time.time() > deadline:
                missing = [n for n in names if n not in up]
                return False, (f"only {have} of {count} Ray nodes joined {address} within {timeout:.0f} s "
                               f"(up: {', '.join(up) or 'none'}" + (f"; missing: {', '.join(missing)}" if missing else "")
                               + "); see the [ray <node>] lines of the missing nodes, or raise RAY_JOIN_TIMEOUT")
            time.sleep(poll_s)
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", required=True, help="host:port of the Ray head (GCS)")
    p.add_argument("--nodes", nargs="+", required=True, help="expected node names, or one integer count")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait (default 300)")
    p.add_argument("--watch-pid", type=int, default=None, help="fail at once when this process dies")
    args = p.parse_args(argv)
    expected: list[str] | int = int(args.nodes[0]) if len(args.nodes) == 1 and args.nodes[0].isdigit() else args.nodes
    ok, msg = wait_for_nodes(args.address, expected, args.timeout, args.watch_pid)
    recipe = os.environ.get("RLHF_RECIPE", "rlhf")
    print(f"[{recipe}] {msg}" if ok else f"[{recipe}] ERROR: {msg}", file=sys.stdout if ok else sys.stderr, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Child process of :mod:`rlhf.rewards.math_check`: one Hugging Face ``math-verify`` equivalence check per request.

Started as a script (``python -c <boot> <this file>``), so it imports nothing of ``rlhf``: only the standard
library and ``math_verify``.  Protocol, one JSON object per line:

* out, once after the imports: ``{"ready": true}`` (or ``{"ready": false, "error": "..."}`` and exit 1);
* in: ``{"id": n, "gold": "$...$", "pred": "$...$", "t": seconds}`` (strings that math-verify parses);
* out: ``{"id": n, "eq": true|false}``, with ``"error"`` when math-verify raised.

Here the check runs in this process's main thread, where math-verify's own ``signal.alarm`` time limits
(``parsing_timeout``, ``timeout_seconds``; whole seconds, ``t`` each) work; the parent kills this process when
even those do not bring an answer in time (a computation stuck in C code).  The process exits at the end
of its input, so it never outlives its parent.  Its address space is capped (``_MEMORY_LIMIT``) so that a
pathological expression ends in a MemoryError rather than in swapping.
"""
import json
import logging
import sys

_MEMORY_LIMIT = 4 << 30  # bytes of address space


def _limit_memory() -> None:
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        cap = _MEMORY_LIMIT if hard == resource.RLIM_INFINITY else min(_MEMORY_LIMIT, hard)
        if soft == resource.RLIM_INFINITY or soft > cap:
            resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    except (ImportError, ValueError, OSError):  # not on this platform / not allowed: run without the cap
        pass


def _check(req: dict, parse, verify, configs) -> dict:
    t = max(1, int(req.get("t", 2)))
    gold_cfg, pred_cfg = configs
    gold = parse(str(req["gold"]), extraction_config=gold_cfg, parsing_timeout=t)
    pred = parse(str(req["pred"]), extraction_config=pred_cfg, parsing_timeout=t)
    eq = bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=t))
    return {"id": req.get("id"), "eq": eq}


def main() -> int:
    """Serve checks from stdin until it closes (protocol in the module doc); 0 at the end, 1 without math-verify."""
    out = sys.stdout
    sys.stdout = sys.stderr  # anything a library prints goes to stderr; stdout carries the protocol only
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "Timeout during comparison" etc. per sample
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it to the caller
        out.write(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        out.flush()
        return 1
    _limit_memory()
    configs = ([LatexExtractionConfig()], [LatexExtractionConfig(), ExprExtractionConfig()])
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
        except ValueError as e:
            res = {"id": None, "eq": False, "error": f"bad request: {e}"}
        else:
            try:
                res = _check(req, parse, verify, configs)
            except BaseException as e:  # noqa: BLE001 - math-verify's TimeoutException, MemoryError, RecursionError
                if isinstance(e, KeyboardInterrupt):
                    raise
                res = {"id": req.get("id"), "eq": False, "error": f"{type(e).__name__}: {e}"[:500]}
        out.write(json.dumps(res) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

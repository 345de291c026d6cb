"""A stand-in for ``rlhf.main`` started by rlhf.launcher.run_node in tests: prints where the agent put it and exits
with ``PROBE_EXIT_CODE`` on rank ``PROBE_FAIL_RANK`` (0 elsewhere)."""
import os
import sys

if __name__ == "__main__":
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "OMP_NUM_THREADS")
    line = "PROBE " + " ".join(f"{k}={os.environ.get(k)}" for k in keys) + " ARGS=" + ",".join(sys.argv[1:]) + "\n"
    os.write(1, line.encode())  # one write: the ranks share the agent's stdout (print's text and newline interleaved)
    if os.environ.get("PROBE_FAIL_RANK") == os.environ.get("RANK"):
        sys.exit(int(os.environ.get("PROBE_EXIT_CODE", "1")))

"""Summarise a py-spy raw profile (``py-spy record --format raw``; one ``frame;frame;... count`` line per
distinct stack) phase by phase: for each phase (a function name on the stack), its share of the samples,
then the functions that take the most of it (self time = leaf frame; inclusive = anywhere on the stack).

    python benchmarks/pyspy_summary.py PROFILE.txt [--phase compute_log_prob --phase update_policy ...] [--top 12]

The default phases are PPOTrainer.train_step's: generate, compute_log_prob, update_policy, sync_weights.
"""
import argparse
import re
from collections import Counter

DEFAULT_PHASES = ("train_step", "generate", "compute_log_prob", "update_policy", "sync_weights")
_FRAME = re.compile(r"^(?P<func>[^ ]+) \((?P<file>[^:]+)(:(?P<line>\d+))?\)$")


def parse(path):
    """[(frames (root first), count)] of a raw profile."""
    stacks = []
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            stack, _, count = line.rpartition(" ")
            stacks.append((stack.split(";"), int(count)))
    return stacks


def short(frame):
    """`func (path/to/file.py:12)` -> `file.py:func`."""
    m = _FRAME.match(frame)
    if not m:
        return frame[:80]
    return f"{m.group('file').rsplit('/', 1)[-1]}:{m.group('func')}"


def func(frame):
    """The bare function name of a frame (`Class.method` -> `method`)."""
    m = _FRAME.match(frame)
    return m.group("func").rsplit(".", 1)[-1] if m else frame


def summarise(stacks, phases, top, interesting):
    total = sum(c for _, c in stacks)
    print(f"{total} samples")
    for phase in phases:
        sel = [(s, c) for s, c in stacks if any(func(f) == phase for f in s)]
        n = sum(c for _, c in sel)
        if not n:
            print(f"\n== {phase}: no samples")
            continue
        print(f"\n== {phase}: {n} samples ({100 * n / total:.1f}% of all)")
        leaf = Counter()
        incl = Counter()
        for s, c in sel:
            leaf[short(s[-1])] += c
            for name in {short(f) for f in s}:
                if any(k in name for k in interesting):
                    incl[name] += c
        print("  self (leaf):")
        for name, c in leaf.most_common(top):
            print(f"    {100 * c / n:5.1f}%  {name}")
        if incl:
            print("  inclusive (selected frames):")
            for name, c in incl.most_common(top):
                print(f"    {100 * c / n:5.1f}%  {name}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile")
    ap.add_argument("--phase", action="append", default=None)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--match", action="append", default=None,
                    help="substrings of frames to report inclusive time for (default: a set of known hot spots)")
    a = ap.parse_args()
    interesting = a.match or ["forward_backward", "forward_step", "backward_step", "_token_outputs", "left_align",
                              "vocab_parallel_log_probs", "all_reduce", "all_gather", "broadcast", "barrier",
                              "optimizer_step", "step", "finalize_model_grads", "get_grad_norm", "clip_grad",
                              "_run_tensor", "produce", "deliver", "update_weights_from_tensor", "ray.get", "get",
                              "dumps", "serialize", "put", "TransformerLayer.forward", "SelfAttention",
                              "DotProductAttention", "MLP.forward", "ColumnParallelLinear", "RowParallelLinear",
                              "gather_metrics", "all_gather_object", "broadcast_object_list", "wait", "_poll"]
    summarise(parse(a.profile), a.phase or DEFAULT_PHASES, a.top, interesting)

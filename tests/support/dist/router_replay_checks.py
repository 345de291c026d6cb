"""MoE routing replay (parallel/router_replay.py) under EP2, PP2 and TP2 (sequence parallel) against one process's
unsharded run (2 gloo processes; launched by tests/e2e/test_router_replay_dist.py):

    torchrun --nproc_per_node=2 tests/support/dist/router_replay_checks.py --workdir DIR

A tiny Qwen3-MoE, a Mixtral and a DeepSeek-V3 (first layer dense, grouped sigmoid routing); per layout: the recorded routing
equals the unsharded model's, a given random routing is replayed exactly (recorded back token by token, layer by
layer) and gives the unsharded model's log-probs under the same replay (<= 1e-5).  Prints `CHECK <name> PASS|FAIL
<detail>` on rank 0.
"""
import argparse
import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from parallel.distributed import init_distributed, init_model_parallel, set_seed  # noqa: E402
from tests.support.dist.checks import run_check  # noqa: E402
from tests.support.dist.family_checks import padded_batch  # noqa: E402

FAMILIES = ["qwen3_moe", "mixtral", "deepseek_v3"]
LAYOUTS = [(1, 1, 2), (1, 2, 1), (2, 1, 1)]  # (tp, pp, ep)


def batch():
    """family_checks' padded batch of 4 rows (a left-padded prompt, a right-padded response)."""
    return padded_batch(B=4)


def given_routing(L, E, k, seed=5, B=4, S=12):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, S, L, E, generator=g).argsort(-1)[..., :k]


def run(path, routed=None):
    """(log-probs [B, S], recorded routing [B, S, L, k]) of the model at `path` in the current layout."""
    from transformers import AutoConfig

    from parallel.forward import forward_backward
    from parallel.models import build_model_chunks
    from parallel.router_replay import RoutingReplay

    set_seed(1)
    bundle = build_model_chunks(AutoConfig.from_pretrained(path), "actor", path, moe_enable_routing_replay=True)
    rr = RoutingReplay(bundle.chunks)
    try:
        b = batch() if routed is None else {**batch(), "routed_experts": routed}
        with torch.no_grad():
            out = forward_backward(bundle.chunks, b, kind="log_probs", vocab_size=bundle.spec.vocab_size,
                                   micro_batch_size=2, routing=rr, record_routing=True)
        return out["log_probs"].cpu(), out["routed_experts"].cpu()
    finally:
        rr.close()


def grads(path, routed, recompute):
    """Router and expert gradients of one replayed training pass (4 micro batches) in the current layout."""
    from transformers import AutoConfig

    from parallel.forward import forward_backward
    from parallel.models import build_model_chunks
    from parallel.router_replay import RoutingReplay

    set_seed(1)
    bundle = build_model_chunks(AutoConfig.from_pretrained(path), "actor", path, moe_enable_routing_replay=True,
                                recompute=recompute)
    rr = RoutingReplay(bundle.chunks)
    try:
        forward_backward(bundle.chunks, {**batch(), "routed_experts": routed}, kind="log_probs",
                         vocab_size=bundle.spec.vocab_size, micro_batch_size=1, forward_only=False, routing=rr,
                         loss_fn=lambda outs, mb: (-outs["log_probs"].sum(), {}))
    finally:
        rr.close()
    return {n: p.grad.clone() for c in bundle.chunks for n, p in c.named_parameters()
            if p.grad is not None and ("router" in n or "experts" in n)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    init_distributed()
    from transformers import AutoConfig

    from tests.support.model_families import make_family_model

    paths = {k: os.path.join(args.workdir, f"hf_{k}") for k in FAMILIES}
    if dist.get_rank() == 0:
        for k, p in paths.items():
            make_family_model(p, k, num_layers=2)
    dist.barrier()
    mask = batch()["attention_mask"].bool()
    ref = {}
    init_model_parallel(1, 1)  # both ranks: the unsharded model (data parallel 2, same batch)
    for kind, path in paths.items():
        hf = AutoConfig.from_pretrained(path)
        E = getattr(hf, "num_experts", None) or hf.n_routed_experts
        G = given_routing(hf.num_hidden_layers, E, hf.num_experts_per_tok)
        ref[kind] = (run(path), run(path, G), G)
    for tp, pp, ep in LAYOUTS:
        init_model_parallel(tp, pp, ep=ep)
        lay = f"tp{tp}pp{pp}" + (f"ep{ep}" if ep > 1 else "")
        for kind, path in paths.items():
            (own_lp, own_r), (rep_lp, rep_r), G = ref[kind]

            def own():
                lp, r = run(path)
                d = (lp - own_lp).abs()[mask].max().item()
                same = torch.equal(r.sort(-1).values, own_r.sort(-1).values)
                return same and d <= 1e-5, f"routing equal={same} log_probs max_abs_diff={d:.2e}"

            def replay():
                lp, r = run(path, G)
                moe = (own_r >= 0).all(-1).all(0).all(0)  # [L]: MoE layers (dense ones record -1)
                same = torch.equal(r[:, :, moe].sort(-1).values, G[:, :, moe].sort(-1).values)
                d = (lp - rep_lp).abs()[mask].max().item()
                changed = (rep_lp - own_lp).abs()[mask].max().item()
                return same and bool(moe.any()) and d <= 1e-5 and changed > 1e-4, \
                    (f"replayed == given: {same} (MoE layers {moe.tolist()}); log_probs vs unsharded replay "
                     f"max_abs_diff={d:.2e}; vs own routing {changed:.2e}")

            run_check(f"router_replay_{kind}_{lay}_records_own_routing", own)
            run_check(f"router_replay_{kind}_{lay}_replays_given_routing", replay)
            if (tp, pp, ep) == (1, 2, 1) and kind == "qwen3_moe":
                def recompute():  # 1F1B: stage 0 runs F0 F1 before B0, so the backward needs the queue, not the target
                    plain, full = grads(path, G, None), grads(path, G, "full")
                    worst = max((plain[n] - full[n]).abs().max().item() for n in plain)
                    return plain.keys() == full.keys() and bool(plain) and worst <= 1e-6, \
                        f"{len(plain)} router/expert grads, full recompute vs none max_abs_diff={worst:.2e}"

                run_check(f"router_replay_{kind}_{lay}_full_recompute_replays_in_backward", recompute)
    dist.barrier()


if __name__ == "__main__":
    main()

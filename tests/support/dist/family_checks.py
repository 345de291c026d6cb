"""Every supported model family vs Hugging Face under TP / PP / EP (gloo, CPU). Launched by
tests/e2e/test_model_families_dist.py:

    torchrun --nproc_per_node=4 tests/support/dist/family_checks.py --workdir DIR

Tiny random models shaped like real releases (tests/support/model_families.py).  Per family and layout:
logits vs HF (fp32, <= 1e-5), HF -> megatron -> HF bitwise; log-probs vs HF at TP2; MoE: EP2 and
TP2xEP2, `moe/*` metrics vs hand-computed values, a distributed-checkpoint reshard (saved at
TP2xEP2, loaded at PP2); an uneven pipeline.  Prints `CHECK <name> PASS|FAIL <detail>` on rank 0.
"""
import argparse
import os
import shutil
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from parallel.distributed import init_distributed, init_model_parallel, set_seed  # noqa: E402
from tests.support.dist.checks import run_check, summary  # noqa: E402

DENSE = ["llama3", "llama3_custom", "qwen2_5", "qwen3"]
MOE = ["qwen3_moe", "mixtral", "deepseek_v3"]
# (tp, pp, ep, num_layers_in_first_pipeline_stage)
LAYOUTS = [(1, 1, 1, None), (2, 1, 1, None), (1, 2, 1, None), (1, 1, 2, None), (2, 1, 2, None), (1, 2, 1, 1)]


def layout_name(tp, pp, ep, first):
    return f"tp{tp}pp{pp}" + (f"ep{ep}" if ep > 1 else "") + (f"_first{first}" if first else "")


def init_parallel(tp, pp, ep):
    """megatron parallel state with expert parallelism."""
    init_model_parallel(tp, pp, ep=ep)


def padded_batch(seed=0, B=3, S=12, vocab=1000):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (B, S), generator=g)
    am = torch.ones_like(ids)
    am[0, :4] = 0
    am[2, -3:] = 0
    ids = torch.where(am.bool(), ids, torch.full_like(ids, 3))
    return dict(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(1) - 1).clamp(min=0))


def fb(chunks, batch, **kw):
    from parallel.forward import forward_backward

    return {k: v.cpu() for k, v in forward_backward(chunks, batch, **kw).items()}


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


REF = {}


def hf_logits(kind, path):
    if kind not in REF:
        with torch.no_grad():
            REF[kind] = hf_model(path)(**padded_batch()).logits.float()
    return REF[kind]


def build(path, first=None, hf=True):
    from transformers import AutoConfig

    from parallel.models import build_model_chunks

    extra = {"num_layers_in_first_pipeline_stage": first} if first else {}
    return build_model_chunks(AutoConfig.from_pretrained(path), "actor", path if hf else None, **extra)


def logits_check(bundle, kind, path):
    batch = padded_batch()
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        out = fb(bundle.chunks, batch, kind="logits", vocab_size=bundle.spec.vocab_size)["logits"]
    d = (out[mask] - hf_logits(kind, path)[mask]).abs().max().item()
    return d <= 1e-5, f"max_abs_diff={d:.2e}"


def log_probs_check(bundle, kind, path):
    """Log-probs vs HF's log_softmax, also for an odd length (11: padded to a multiple of tp
    inside forward under sequence parallelism; causal, so HF's prefix is the reference)."""
    full = padded_batch()
    logp = torch.log_softmax(hf_logits(kind, path), -1)
    worst = 0.0
    for S in (12, 11):
        batch = {k: v[:, :S] for k, v in full.items()}
        mask = batch["attention_mask"].bool()
        with torch.no_grad():
            res = fb(bundle.chunks, batch, kind="log_probs", vocab_size=bundle.spec.vocab_size, micro_batch_size=1)
        ref = torch.zeros_like(res["log_probs"])
        ref[:, 1:] = logp[:, : S - 1].gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
        valid = mask.clone()
        valid[:, 1:] &= mask[:, :-1]
        valid[torch.arange(3), mask.int().argmax(1)] = False
        worst = max(worst, (res["log_probs"][valid] - ref[valid]).abs().max().item())
    return worst <= 1e-5, f"max_abs_diff={worst:.2e} (lengths 12 and 11)"


def round_trip_check(bundle, path, out):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from parallel.convert import HFCheckpointReader, save_hf_checkpoint

    save_hf_checkpoint(bundle.chunks, bundle.spec, AutoConfig.from_pretrained(path), out)
    ok, detail = True, ""
    if dist.get_rank() == 0:
        orig = load_file(os.path.join(path, "model.safetensors"))
        with HFCheckpointReader(out) as r:
            new = {n: r.get(n) for n in r.weight_map}
        if set(orig) != set(new):
            ok, detail = False, f"names differ: only_hf={sorted(set(orig) - set(new))[:3]} " \
                                f"only_export={sorted(set(new) - set(orig))[:3]}"
        else:
            bad = [n for n in orig if orig[n].dtype != new[n].dtype or not torch.equal(orig[n], new[n])]
            ok, detail = not bad, (f"tensors differ: {bad[:3]}" if bad else f"{len(orig)} tensors bitwise equal")
            if ok:
                hf_model(out)  # loads with transformers
        shutil.rmtree(out, ignore_errors=True)
    dist.barrier()
    return ok, detail


def moe_hand_metrics(path, shards):
    """Per-layer token counts and the Switch aux loss (E * sum_i f_i P_i with f_i = count_i / (T k),
    P_i the mean router probability; per data-parallel shard, as each rank computes it) from HF's
    own router logits.  Returns (min count, max count, aux loss averaged over layers and shards)."""
    model = hf_model(path)
    k = model.config.num_experts_per_tok
    counts, losses = 0, []
    for batch in shards:
        with torch.no_grad():
            out = model(**batch, output_router_logits=True)
        per_layer = []
        for logits in out.router_logits:  # [T, E] per layer
            T, E = logits.shape
            probs = torch.softmax(logits.double(), -1)
            top = torch.topk(logits, k, -1).indices.flatten()
            c = torch.zeros(E, dtype=torch.float64).scatter_add_(0, top, torch.ones(top.numel(), dtype=torch.float64))
            per_layer.append(c)
            losses.append(E * ((c / (T * k)) * probs.mean(0)).sum())
        counts = counts + torch.stack(per_layer)
    return counts.min().item(), counts.max().item(), torch.stack(losses).mean().item()


def moe_metrics_check(bundle, path):
    """One training forward/backward: moe/* equal the values computed from HF's router logits."""
    from parallel.moe import MoEMetrics

    full = padded_batch(seed=3, B=4, S=10)
    full["attention_mask"][:] = 1
    full["position_ids"] = torch.arange(10).expand(4, 10).contiguous()
    from megatron.core import parallel_state as ps

    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    local = {k: v.chunk(dp)[r] for k, v in full.items()}
    moe = MoEMetrics(bundle.chunks)
    moe.reset()

    def loss_fn(outs, mb):
        loss = -outs["log_probs"][:, 1:].mean()
        return loss, {"loss": loss}

    from parallel.forward import forward_backward

    forward_backward(bundle.chunks, local, kind="log_probs", vocab_size=bundle.spec.vocab_size,
                     micro_batch_size=local["input_ids"].shape[0], loss_fn=loss_fn, forward_only=False)
    got = moe.collect()
    moe.close()
    lo, hi, aux = moe_hand_metrics(path, [{k: v.chunk(dp)[i] for k, v in full.items()} for i in range(dp)])
    ok = (got.get("moe/tokens_per_expert_min") == lo and got.get("moe/tokens_per_expert_max") == hi
          and abs(got.get("moe/load_balancing_loss", -1) - aux) <= 1e-5 * max(1.0, aux))
    return ok, f"got={got} hand=(min {lo}, max {hi}, aux {aux:.6f})"


def walk_check(bundle):
    """walk_local_tensors: unmapped persistent buffers are listed as skipped, a name_map hook maps
    them, the tied output copy is skipped, and the order is identical on every rank of the TP group."""
    from megatron.core import parallel_state as ps

    from parallel.convert import ParamRole, walk_local_tensors

    chunk = bundle.chunks[0]
    chunk.register_buffer("frozen_gain", torch.ones(bundle.spec.hidden_size), persistent=True)
    try:
        skipped = []
        names = [t.local_name for t in walk_local_tensors(bundle.chunks, bundle.spec, skipped=skipped)]
        hook = lambda c, n, t: ParamRole("replicated", ("model.norm.weight",)) if n == "frozen_gain" else None  # noqa
        mapped = {t.local_name: t.role for t in walk_local_tensors(bundle.chunks, bundle.spec, name_map=hook)}
    finally:
        del chunk._buffers["frozen_gain"]
    everyone = [None] * ps.get_tensor_model_parallel_world_size()
    dist.all_gather_object(everyone, names, group=ps.get_tensor_model_parallel_group())
    ok = (skipped == ["chunk0.frozen_gain"] and "frozen_gain" not in names and "output_layer.weight" not in names
          and mapped["frozen_gain"].hf_names == ("model.norm.weight",) and all(e == names for e in everyone))
    return ok, f"skipped={skipped} walked={len(names)}"


def dcp_save(bundle, ckpt):
    from parallel.dist_checkpoint import save_sharded

    save_sharded(ckpt, bundle.chunks, common={"step": 3})


def dcp_load_check(kind, path, ckpt, first=None):
    from safetensors.torch import load_file

    from parallel.convert import iter_hf_tensors
    from parallel.dist_checkpoint import load_sharded

    bundle = build(path, first, hf=False)
    common = load_sharded(ckpt, bundle.chunks)
    orig = load_file(os.path.join(path, "model.safetensors"))
    exact = all(torch.equal(t.cpu(), orig[n]) for n, t in iter_hf_tensors(bundle.chunks, bundle.spec))
    ok, detail = logits_check(bundle, kind, path)
    return ok and exact and common.get("step") == 3, f"weights_bitwise_equal={exact} {detail}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--families", default=",".join(DENSE + MOE))
    ap.add_argument("--layouts", default=None, help="comma-separated layout names to run (default: all)")
    args = ap.parse_args()
    init_distributed()
    from tests.support.model_families import make_family_model

    kinds = args.families.split(",")
    paths = {k: os.path.join(args.workdir, f"hf_{k}") for k in kinds}
    if dist.get_rank() == 0:
        for k, p in paths.items():
            make_family_model(p, k)
    dist.barrier()
    world = dist.get_world_size()
    ckpt = os.path.join(args.workdir, "dcp_qwen3_moe")
    for tp, pp, ep, first in LAYOUTS:
        if world % (tp * pp) or (world // (tp * pp)) % ep:
            continue
        init_parallel(tp, pp, ep)
        set_seed(1234)
        lay = layout_name(tp, pp, ep, first)
        if args.layouts and lay not in args.layouts.split(","):
            continue
        for kind in kinds:
            if ep > 1 and kind not in MOE or first and kind not in ("qwen3", "qwen3_moe"):
                continue
            box = {}

            def do_build():
                box["b"] = build(paths[kind], first)
                return logits_check(box["b"], kind, paths[kind])

            run_check(f"logits_{kind}_{lay}", do_build)
            if "b" not in box:
                continue
            bundle = box["b"]
            run_check(f"round_trip_{kind}_{lay}",
                      lambda: round_trip_check(bundle, paths[kind], os.path.join(args.workdir, f"rt_{kind}_{lay}")))
            if (tp, pp, ep) == (2, 1, 1):
                run_check(f"log_probs_{kind}_{lay}", lambda: log_probs_check(bundle, kind, paths[kind]))
                if kind == "qwen3":  # tied: the last stage's output_layer copy must be skipped
                    run_check(f"walk_{kind}_{lay}", lambda: walk_check(bundle))
            if kind == "qwen3_moe" and (tp, pp, ep) == (2, 1, 2):
                run_check(f"moe_metrics_{kind}_{lay}", lambda: moe_metrics_check(bundle, paths[kind]))
                dcp_save(bundle, ckpt)  # the training pass left the weights unchanged (no optimizer step)
    # reshard: saved at TP2 x EP2 above, loaded at PP2 here
    if "qwen3_moe" in kinds and os.path.isdir(ckpt) and not args.layouts:
        init_parallel(1, 2, 1)
        set_seed(99)
        run_check("dist_checkpoint_qwen3_moe_tp2ep2_save_pp2_load",
                  lambda: dcp_load_check("qwen3_moe", paths["qwen3_moe"], ckpt))
    summary()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

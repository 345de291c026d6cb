"""The checks of scripts/gpu_smoke_megatron.py, in order; each returns (ok, detail).  State flows from one check to
the next (models, log-probs, values), so a failed build fails the rest with a clear message."""
from __future__ import annotations

import gc
import math
import os

import torch

import gpu_smoke_lib as lib

KEYS = ("input_ids", "attention_mask", "position_ids")
GiB = 1 << 30


def valid_token_mask(mask: torch.Tensor) -> torch.Tensor:
    """Tokens with a prediction: real, with a real predecessor (not the first real token)."""
    valid = mask.bool().clone()
    valid[:, 1:] &= mask[:, :-1].bool()
    valid[torch.arange(mask.shape[0], device=mask.device), mask.int().argmax(1)] = False
    valid[:, 0] = False
    return valid


class SmokeRun:
    def __init__(self, size: str, device: str, workdir: str, tolerance: float):
        self.size, self.device, self.workdir, self.tolerance = size, device, workdir, tolerance
        self.memory_lines: list[str] = []
        b = lib.SIZES[size][1]
        self.micro, self.R = b["micro"], b["response"]

    def checks(self):
        return [self.check_environment, self.check_build_bf16_actor_critic_reference, self.check_old_and_ref_log_probs,
                self.check_device_rule, self.check_values, self.check_actor_update, self.check_critic_update,
                self.check_memory_plan_vs_measured, self.check_dpo_step, self.check_checkpoint_save_load,
                self.check_hf_export]

    # ------------------------------------------------------------------ helpers
    def fb(self, chunks, batch, **kw):
        from parallel.forward import forward_backward

        kw.setdefault("micro_batch_size", self.micro)
        return forward_backward(chunks, {k: batch[k] for k in batch}, **kw)

    def log_probs(self, chunks, batch):
        """Log-probs with every chunk in eval mode (as the reference is built), the modes restored after: the
        actor and the reference are compared like with like."""
        modes = [c.training for c in chunks]
        for c in chunks:
            c.eval()
        try:
            with torch.no_grad():
                return self.fb(chunks, batch, kind="log_probs", vocab_size=self.vocab)["log_probs"]
        finally:
            for c, m in zip(chunks, modes):
                c.train(m)

    def hf_reference(self, path, dtype=torch.float32):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(self.device).eval()

    def hf_log_probs(self, model, batch):
        with torch.no_grad():
            logits = model(**{k: batch[k] for k in KEYS}).logits.float()
        lp = torch.zeros(batch["input_ids"].shape, device=logits.device)
        lp[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
        return lp

    def train_step(self, state, batch, kind, loss_fn, **kw):
        from parallel.optim import optimizer_step, zero_grads

        zero_grads(state)
        metrics = self.fb(state.model, batch, kind=kind, loss_fn=loss_fn, forward_only=False, **kw)
        return metrics, optimizer_step(state)

    def eval_loss(self, state, batch, kind, loss_fn, **kw):
        with torch.no_grad():
            metrics = self.fb(state.model, batch, kind=kind, loss_fn=loss_fn, forward_only=True, **kw)
        return sum(float(m["loss"]) for m in metrics) / len(metrics)

    # ------------------------------------------------------------------ checks
    def check_environment(self):
        from parallel.kernels import kernel_metrics, resolve_kernels

        choice = resolve_kernels()
        self.use_te, self.fused_adam = choice.use_te, lib.optimizer_is_fused()
        self.fused_swiglu = choice.fusions["bias_activation_fusion"]
        on = [n for n, v in choice.fusions.items() if v]
        return True, (f"transformer_engine={choice.use_te} fused={on} fallbacks={kernel_metrics(choice)} "
                      f"fused_adam={self.fused_adam}")

    def check_build_bf16_actor_critic_reference(self):
        from transformers import AutoConfig

        from parallel.distributed import compute_device
        from parallel.forward import batch_to_device
        from rlhf.memory_plan.terms import ModelShape, stage_params
        from parallel.models import build_model_chunks
        from parallel.optim import OptimConfig, build_train_state

        self.path = os.path.join(self.workdir, "hf")
        self.hf_dict = lib.make_hf_model(self.path, self.size)
        self.hf_config = AutoConfig.from_pretrained(self.path)
        kw = dict(params_dtype=torch.bfloat16)
        self.actor = build_model_chunks(self.hf_config, "actor", self.path, **kw)
        self.critic = build_model_chunks(self.hf_config, "critic", self.path, **kw)
        self.reference = build_model_chunks(self.hf_config, "reference", self.path, **kw)
        self.vocab = self.actor.spec.vocab_size
        self.actor_state = build_train_state(self.actor.chunks, self.actor.config, OptimConfig(lr=1e-4, clip_grad=1.0))
        self.critic_state = build_train_state(self.critic.chunks, self.critic.config, OptimConfig(lr=1e-4))
        self.batch = batch_to_device(lib.rl_batch(self.size, self.vocab), compute_device())  # moved once
        shape = ModelShape.from_hf_config(self.hf_dict)
        counts = {}
        for bundle, head in ((self.actor, False), (self.critic, True)):
            n = sum(p.numel() for p in bundle.chunks[0].parameters())
            counts[bundle.role] = (n, stage_params(shape, 1, shape.num_layers, True, True, value_head=head)[0])
        params = [p for b in (self.actor, self.critic, self.reference) for c in b.chunks for p in c.parameters()]
        device_ok = all(p.device.type == self.device for p in params)
        bf16 = all(p.dtype == torch.bfloat16 for p in params)  # norms too (parallel.models.cast_params_)
        ok = all(n == planned for n, planned in counts.values()) and bf16 and device_ok
        return ok, f"params (built, planned) {counts}; all bf16: {bf16}; all on {self.device}: {device_ok}"

    def check_old_and_ref_log_probs(self):
        self.old = self.log_probs(self.actor.chunks, self.batch)
        ref = self.log_probs(self.reference.chunks, self.batch)
        hf = self.hf_reference(self.path)
        expected = self.hf_log_probs(hf, self.batch)
        del hf
        self._free()
        valid = valid_token_mask(self.batch["attention_mask"])
        diff = (self.old - expected)[valid].abs()
        pad_zero = bool((self.old[~valid] == 0).all())
        self.ref_lp = ref
        cfg = self.actor.config
        no_dropout = cfg.hidden_dropout == 0.0 and cfg.attention_dropout == 0.0
        eval_mode = not any(c.training for c in self.reference.chunks)
        ok = (torch.equal(self.old, ref) and diff.mean() < 0.02 and diff.max() < 0.25 and pad_zero and no_dropout
              and eval_mode)
        return ok, (f"vs HF fp32: mean_abs_diff={diff.mean():.2e} max={diff.max():.2e}; reference == actor (both "
                    f"eval mode, dropout 0: {no_dropout and eval_mode}): {torch.equal(self.old, ref)}; zeros at "
                    f"padding: {pad_zero}")

    def check_device_rule(self):
        """Outputs (and loss_fn metrics) come back on the device of the batch given."""
        cpu = {k: v.cpu() for k, v in self.batch.items()}
        lp_cpu = self.log_probs(self.actor.chunks, cpu)

        def loss_fn(outs, mb):
            return outs["log_probs"].sum() * 0, {"loss": outs["log_probs"].sum()}

        with torch.no_grad():
            m = self.fb(self.actor.chunks, cpu, kind="log_probs", vocab_size=self.vocab, loss_fn=loss_fn)
        ok = lp_cpu.device.type == "cpu" and self.old.device.type == self.device and m[0]["loss"].device.type == "cpu"
        ok = ok and torch.equal(lp_cpu, self.old.cpu())
        return ok, f"cpu batch -> {lp_cpu.device}, {self.device} batch -> {self.old.device}, metrics -> " \
                   f"{m[0]['loss'].device}; equal values: {torch.equal(lp_cpu, self.old.cpu())}"

    def check_values(self):
        with torch.no_grad():
            values = self.fb(self.critic.chunks, self.batch, kind="values")["values"]
            hf = self.hf_reference(self.path)
            hidden = hf.model(**{k: self.batch[k] for k in KEYS}).last_hidden_state.float()
            head = self.critic.chunks[-1].output_layer.weight.float()
            expected = hidden @ head.t()
        del hf
        self._free()
        mask = self.batch["attention_mask"].bool()
        diff = (values - expected.squeeze(-1))[mask].abs()
        scale = expected.squeeze(-1)[mask].abs().mean()
        S = self.batch["input_ids"].shape[1]
        self.values = values[:, S - self.R - 1:S - 1]  # V(s_t) for each response token t (the token before it)
        ok = bool(diff.mean() < 0.05 * scale and (values[~mask] == 0).all() and torch.isfinite(values).all())
        return ok, f"vs HF trunk x value head: mean_abs_diff={diff.mean():.2e} (mean |value| {scale:.2e})"

    def check_actor_update(self):
        from rlhf import algorithms as algos

        g = torch.Generator().manual_seed(1)
        mask = self.batch["response_mask"]
        batch = dict(self.batch, old_log_probs=self.old[:, -self.R:],
                     advantages=torch.randn(mask.shape, generator=g).to(mask.device) * mask)
        R = self.R

        def loss_fn(outs, mb):
            pg, clipfrac, kl, _ = algos.compute_policy_loss(mb["old_log_probs"], outs["log_probs"][:, -R:],
                                                            mb["advantages"], mb["response_mask"], cliprange=0.2)
            ent = algos.agg_loss(outs["entropy"][:, -R:], mb["response_mask"], "token-mean")
            return pg - 0.0 * ent, {"loss": pg.detach(), "ppo_kl": kl.detach(), "entropy": ent.detach()}

        metrics, step = self.train_step(self.actor_state, batch, "log_probs", loss_fn, vocab_size=self.vocab,
                                        calculate_entropy=True)
        before = sum(float(m["loss"]) for m in metrics) / len(metrics)
        kl = max(abs(float(m["ppo_kl"])) for m in metrics)
        after = self.eval_loss(self.actor_state, batch, "log_probs", loss_fn, vocab_size=self.vocab,
                               calculate_entropy=True)
        self.actor_loss_fn, self.actor_batch = loss_fn, batch
        # first-order check, robust to the step size: log-probs moved along the advantages
        moved = ((self.log_probs(self.actor.chunks, batch)[:, -R:] - batch["old_log_probs"]) * batch["advantages"])
        along = float(moved.sum() / mask.sum())
        ok = not step.skipped and math.isfinite(step.grad_norm) and step.grad_norm > 0 and kl < 1e-3 and along > 0
        return ok, (f"mean (new - old log-prob) x advantage = {along:.2e} (> 0), pg_loss {before:.4f} -> {after:.4f}, "
                    f"grad_norm={step.grad_norm:.3f}, first-pass ppo_kl={kl:.1e}, skipped={step.skipped}")

    def check_critic_update(self):
        from rlhf import algorithms as algos

        mask = self.batch["response_mask"]
        returns = (self.values + 0.5) * mask  # every target 0.5 above the current value
        batch = dict(self.batch, values=self.values, returns=returns)
        S, R = self.batch["input_ids"].shape[1], self.R

        def loss_fn(outs, mb):
            vpreds = outs["values"][:, S - R - 1:S - 1]
            loss, clipfrac = algos.compute_value_loss(vpreds, mb["returns"], mb["values"], mb["response_mask"], 0.5)
            return loss, {"loss": loss.detach()}

        metrics, step = self.train_step(self.critic_state, batch, "values", loss_fn)
        before = sum(float(m["loss"]) for m in metrics) / len(metrics)
        after = self.eval_loss(self.critic_state, batch, "values", loss_fn)
        self.critic_loss_fn, self.critic_batch = loss_fn, batch
        with torch.no_grad():
            new = self.fb(self.critic.chunks, self.batch, kind="values")["values"][:, S - R - 1:S - 1]
        up = float(((new - self.values) * mask).sum() / mask.sum())
        ok = not step.skipped and math.isfinite(step.grad_norm) and up > 0
        return ok, f"values moved {up:+.3f} towards targets +0.5, vf_loss {before:.4f} -> {after:.4f}, " \
                   f"grad_norm={step.grad_norm:.3f}"

    def check_memory_plan_vs_measured(self):
        """Each trainer phase's peak (torch allocator) against the plan of exactly what this process holds."""
        from parallel.optim import optimizer_step, zero_grads

        self._free()
        plan = lib.smoke_plan(self.hf_dict, self.size, self.use_te, self.fused_adam, self.fused_swiglu, self.device)

        def fwd_bwd(state, kind, loss_fn, batch, **kw):
            def run():
                zero_grads(state)
                self.fb(state.model, batch, kind=kind, loss_fn=loss_fn, forward_only=False, **kw)
            return run

        phases = [
            ("actor log-probs", lambda: self.log_probs(self.actor.chunks, self.batch)),
            ("actor fwd/bwd", fwd_bwd(self.actor_state, "log_probs", self.actor_loss_fn, self.actor_batch,
                                      vocab_size=self.vocab, calculate_entropy=True)),
            ("actor optimizer step", lambda: optimizer_step(self.actor_state)),
            ("critic fwd/bwd", fwd_bwd(self.critic_state, "values", self.critic_loss_fn, self.critic_batch)),
        ]
        worst, details = 0.0, []
        for name, fn in phases:
            measured, _ = lib.measure_peak(fn, self.device)
            planned = plan.phase(name).torch_peak
            rel = abs(planned - measured) / measured
            worst = max(worst, rel)
            self.memory_lines.append(f"MEMORY {name}: measured {measured / GiB:.3f} GiB, plan {planned / GiB:.3f} GiB "
                                     f"({planned / measured - 1:+.1%})")
            details.append(f"{name} {planned / measured - 1:+.1%}")
        return worst <= self.tolerance, f"plan vs measured: {', '.join(details)} (tolerance {self.tolerance:.0%})"

    def check_dpo_step(self):
        from rlhf import algorithms as algos

        mask = self.batch["response_mask"]
        R = self.R
        with torch.no_grad():
            ref = (self.log_probs(self.reference.chunks, self.batch)[:, -R:] * mask).sum(1)
        batch = dict(self.batch, ref_logps=ref)  # rows 0, 2, ... chosen; 1, 3, ... rejected

        def loss_fn(outs, mb):
            logps = (outs["log_probs"][:, -R:] * mb["response_mask"]).sum(1)
            loss, chosen, rejected, _ = algos.compute_dpo_loss(logps[0::2], logps[1::2], mb["ref_logps"][0::2],
                                                               mb["ref_logps"][1::2], beta=0.1)
            return loss, {"loss": loss.detach()}

        def margin():
            lp = (self.log_probs(self.actor.chunks, self.batch)[:, -R:] * mask).sum(1)
            return float((lp[0::2] - lp[1::2]).mean())

        m0 = margin()
        metrics, step = self.train_step(self.actor_state, batch, "log_probs", loss_fn, vocab_size=self.vocab)
        before = sum(float(m["loss"]) for m in metrics) / len(metrics)
        after = self.eval_loss(self.actor_state, batch, "log_probs", loss_fn, vocab_size=self.vocab)
        m1 = margin()
        ok = not step.skipped and math.isfinite(step.grad_norm) and m1 > m0
        return ok, (f"chosen - rejected log-prob margin {m0:.3f} -> {m1:.3f}, dpo_loss {before:.4f} -> {after:.4f}, "
                    f"grad_norm={step.grad_norm:.3f}")

    def check_checkpoint_save_load(self):
        """save_sharded -> load into a freshly initialised actor + optimizer: equal weights, and the next step
        of both is bitwise the same."""
        from parallel.convert import iter_hf_tensors
        from parallel.dist_checkpoint import load_sharded, save_sharded
        from parallel.models import build_model_chunks
        from parallel.optim import OptimConfig, build_train_state

        ckpt = os.path.join(self.workdir, "ckpt")
        save_sharded(ckpt, self.actor_state.model, self.actor_state.optimizer,
                     common={"step": 3, "scheduler": self.actor_state.scheduler.state_dict()})
        fresh = build_model_chunks(self.hf_config, "actor", None, params_dtype=torch.bfloat16)
        state = build_train_state(fresh.chunks, fresh.config, OptimConfig(lr=1e-4, clip_grad=1.0))
        common = load_sharded(ckpt, state.model, state.optimizer)
        state.scheduler.load_state_dict(common["scheduler"])
        same = all(torch.equal(a, b) for (_, a), (_, b) in zip(iter_hf_tensors(self.actor.chunks, self.actor.spec),
                                                               iter_hf_tensors(fresh.chunks, fresh.spec)))
        for st in (self.actor_state, state):
            self.train_step(st, self.actor_batch, "log_probs", self.actor_loss_fn, vocab_size=self.vocab,
                            calculate_entropy=True)
        after = all(torch.equal(a, b) for (_, a), (_, b) in zip(iter_hf_tensors(self.actor.chunks, self.actor.spec),
                                                                iter_hf_tensors(fresh.chunks, fresh.spec)))
        del fresh, state
        self._free()
        return same and after and common.get("step") == 3, f"weights equal after load: {same}; after one more " \
                                                           f"step each: {after}"

    def check_hf_export(self):
        from safetensors.torch import load_file

        from parallel.convert import iter_hf_tensors, save_hf_checkpoint

        out = os.path.join(self.workdir, "hf_export")
        save_hf_checkpoint(self.actor.chunks, self.actor.spec, self.hf_config, out)
        files = [f for f in os.listdir(out) if f.endswith(".safetensors")]
        exported = {}
        for f in files:
            exported.update(load_file(os.path.join(out, f)))
        mine = {n: t.cpu() for n, t in iter_hf_tensors(self.actor.chunks, self.actor.spec)}
        bitwise = set(mine) == set(exported) and all(torch.equal(mine[n], exported[n]) for n in mine)
        hf = self.hf_reference(out, dtype=torch.float32)
        lp = self.hf_log_probs(hf, self.batch)
        del hf
        self._free()
        valid = valid_token_mask(self.batch["attention_mask"])
        diff = (self.log_probs(self.actor.chunks, self.batch) - lp)[valid].abs()
        ok = bitwise and diff.mean() < 0.02
        return ok, f"{len(mine)} tensors bitwise equal: {bitwise}; HF reload log-probs mean_abs_diff={diff.mean():.2e}"

    def _free(self):
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()

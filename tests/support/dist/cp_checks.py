"""Context-parallel checks of parallel.forward under torchrun (run from foundation_checks.py's launch).

megatron-core runs CP attention only in Transformer Engine, so a real GPTModel cannot run CP on CPU.
Everything around the attention can: these checks drive the real `forward_backward` (megatron's
schedule, the CP split of inputs and labels, the CP gather of log-probs / entropy / values, megatron's
x cp loss scaling) with a token-wise model (embedding + position embedding + vocab-parallel output
layer, no attention), whose outputs do not depend on which rank holds which tokens.  Reference: the
same model at cp = 1 in the same launch.
"""
import torch
import torch.distributed as dist

V, H, S_MAX = 64, 16, 64


class TokenwiseModel(torch.nn.Module):
    """logits[b, t] = out(emb(ids[b, t]) + pos(position_ids[b, t])), this TP rank's vocab slice
    ([b, s, V / tp]); critic: a value per token ([b, s, 1])."""

    def __init__(self, critic: bool):
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.transformer_config import TransformerConfig

        from megatron.core.enums import ModelType

        super().__init__()
        self.model_type = ModelType.encoder_or_decoder
        self.config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2,
                                        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                                        context_parallel_size=ps.get_context_parallel_world_size(),
                                        pipeline_dtype=torch.float32)
        g = torch.Generator().manual_seed(11)
        self.emb = torch.nn.Parameter(torch.randn(V, H, generator=g) * 0.5)
        self.pos = torch.nn.Parameter(torch.randn(S_MAX, H, generator=g) * 0.5)
        out = torch.randn(1 if critic else V, H, generator=g) * 0.5
        if not critic:
            tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
            out = out[rank * V // tp:(rank + 1) * V // tp]
        self.out = torch.nn.Parameter(out.clone())

    def set_input_tensor(self, tensor):  # megatron's schedule calls it (no pipeline here)
        assert tensor is None or tensor == [None], tensor

    def forward(self, input_ids, position_ids, attention_mask):
        return (self.emb[input_ids] + self.pos[position_ids]) @ self.out.t()


def _batch(S=13, B=4):
    """Left-padded prompts + right-padded responses (odd S: padded to a multiple of 2*cp inside)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, V, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    for b, (left, right) in enumerate([(0, 0), (3, 1), (1, 4), (5, 2)]):
        mask[b, :left] = 0
        if right:
            mask[b, S - right:] = 0
    ids = ids * mask
    pos = (mask.cumsum(1) - 1).clamp(min=0) * mask
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos}


def _run(critic: bool) -> dict:
    """Forward-only outputs, then one loss/backward with 2 micro batches; gradients summed over the world."""
    from parallel.forward import forward_backward

    model = TokenwiseModel(critic)
    batch = _batch()
    kind = "values" if critic else "log_probs"
    with torch.no_grad():
        out = forward_backward([model], batch, kind=kind, vocab_size=V, calculate_entropy=not critic,
                               micro_batch_size=2)
    response = batch["attention_mask"].float()

    def loss_fn(outs, mb):
        m = mb["attention_mask"].float()
        if critic:
            return ((outs["values"] - 0.3) ** 2 * m).sum() / m.sum(), {}
        loss = -(outs["log_probs"] * m).sum() / m.sum() - 0.01 * (outs["entropy"] * m).sum() / m.sum()
        return loss, {"n": m.sum()}

    forward_backward([model], dict(batch, response=response), kind=kind, vocab_size=V,
                     calculate_entropy=not critic, micro_batch_size=2, loss_fn=loss_fn, forward_only=False)
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)
        grads[name] = grad
    return {"out": out, "grads": grads}


def check_context_parallel(init_model_parallel, world: int):
    """(ok, detail): TP2 x CP2 (4 ranks) vs TP2 x CP1 x DP2 on the same batch: log-probs, entropy and
    values equal, and the gradients summed over the ranks / cp (what megatron's DDP averages over
    dp x cp) equal the cp = 1 ones summed over TP (dp copies divided out)."""
    if world % 4:
        return True, f"skipped: needs 4 ranks (world={world})"
    results = {}
    for cp in (1, 2):
        init_model_parallel(2, 1, cp=cp)
        results[cp] = {"actor": _run(False), "critic": _run(True)}
    worst_out, worst_grad, shapes = 0.0, 0.0, True
    for role in ("actor", "critic"):
        a, b = results[1][role], results[2][role]
        for k, t in a["out"].items():
            shapes &= tuple(b["out"][k].shape) == tuple(t.shape) == (4, 13)
            worst_out = max(worst_out, (t - b["out"][k]).abs().max().item())
        for n, g in a["grads"].items():
            ref = g / (world // 2)  # the cp=1 launch has world/2 identical data-parallel copies
            worst_grad = max(worst_grad, ((b["grads"][n] / 2 - ref).abs().max() / ref.abs().max()).item())
    ok = shapes and worst_out <= 1e-6 and worst_grad <= 1e-5
    return ok, f"outputs_max_abs_diff={worst_out:.2e} grads_max_rel_diff={worst_grad:.2e} shapes_ok={shapes}"

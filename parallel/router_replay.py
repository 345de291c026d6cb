"""MoE routing replay (verl's R2 / R3) through megatron-core's RouterReplay, and the routing-agreement metric.

Routing replay makes a megatron forward use GIVEN experts per token and layer instead of the router's own top-k
(megatron-core 0.16.1, transformer/moe/router_replay.py: with ``TransformerConfig.moe_enable_routing_replay`` each
TopKRouter owns a ``RouterReplay``; action REPLAY_FORWARD gathers the router's scores at the given indices, so the
gate weights stay differentiable while the expert choice is fixed).  verl's two modes
(verl/utils/megatron/router_replay_utils.py, examples/router_replay):

* ``R2``: the trainer's old-log-prob forward records its routing; the update forwards replay it (routing fixed
  within a step while the weights change).
* ``R3``: the rollout engine's routing (SGLang's ``return_routed_experts``) is replayed in the old-log-prob and the
  update forwards, so the trainer computes log-probs through the experts that produced the tokens.

Layout.  Routing travels with a batch as ``routed_experts`` [B, S, L, k] (:data:`ROUTING_DTYPE` int16: a quarter of
int64's host memory, up to 32767 experts; any integer dtype is accepted), aligned with ``input_ids`` [B, S]
(token t's experts in global layer l; L = the model's ``num_layers``; dense layers and padding hold any valid
indices), the same left-padded prompt / right-padded response layout as every batch tensor (parallel.forward).
Inside the model a router sees the micro batch's tokens as ``[s, b]`` flattened sequence-major (token index
``s * b_size + b``), of its own sequence shard under sequence parallelism; :meth:`RoutingReplay.set_replay` cuts
the same shard.  Each pipeline stage replays its own layers (global index ``layer_number - 1``), each virtual
chunk its own; expert parallelism needs nothing more (routers run on all local tokens before the dispatch).

Under full recompute the backward's recomputed routers replay too (megatron's REPLAY_BACKWARD queue, see
:meth:`RoutingReplay.after_forward`).  Not supported: context parallelism (tokens are split in 2*cp load-balanced
chunks; raised at the call).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from parallel import devices

MODES = ("disabled", "R2", "R3")
ROUTING_DTYPE = torch.int16  # expert indices as a batch holds them


def _routers(chunk):
    """[(global layer index, TopKRouter)] of one model chunk (MoE layers only)."""
    from parallel.convert import unwrap_model

    out = []
    for layer in unwrap_model(chunk).decoder.layers:
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if router is not None:
            out.append((layer.layer_number - 1, router))
    return out


def filler(shape: tuple, topk: int, device=None) -> torch.Tensor:
    """[*shape, k] :data:`ROUTING_DTYPE` holding experts 0..k-1 per token: a valid routing for tokens whose routing
    matters to nothing (padding, the last response token, which no engine forward saw and whose output no log-prob
    uses)."""
    return torch.arange(topk, device=device, dtype=ROUTING_DTYPE).expand(*shape, topk).clone()


def pad_routing(routed: torch.Tensor, pad: int) -> torch.Tensor:
    """[B, S, L, k] -> [B, S + pad, L, k], the new positions filled by :func:`filler`."""
    B, S, L, k = routed.shape
    return torch.cat([routed, filler((B, pad, L), k, routed.device).to(routed.dtype)], 1)


def routing_agreement(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(pairs that agree, pairs compared): over the (token, MoE layer) pairs where ``mask`` [B, S] is true, the pairs
    whose trainer top-k SET equals the engine's.  trainer, engine: [B, S, L, k] expert indices; layers where
    either side holds only -1 (dense) are skipped.  `moe/routing_agreement` = agree / compared."""
    t, _ = trainer.sort(-1)
    e, _ = engine.to(trainer.device).sort(-1)
    layer_ok = (t >= 0).all(-1) & (e >= 0).all(-1)  # [B, S, L]
    pairs = mask.bool().unsqueeze(-1) & layer_ok
    same = (t == e).all(-1) & pairs
    return float(same.sum()), float(pairs.sum())


class RoutingReplay:
    """Routing record / replay on one model's chunks (built with ``moe_enable_routing_replay=True``).

    Per :func:`parallel.forward.forward_backward` call: :meth:`begin` (``replay``: the batch holds
    ``routed_experts`` to replay; ``record``: keep what the routers choose), then per micro batch the forward step
    calls :meth:`set_replay` before the chunk's forward, and :meth:`end` clears megatron's replay state.
    :meth:`recorded` returns what the routers chose (the replayed routing under replay) as [B, S, L, k].

    Raises ValueError for a model without MoE layers or without ``moe_enable_routing_replay``.
    """

    def __init__(self, model_chunks):
        from parallel.convert import unwrap_model

        cfg = unwrap_model(model_chunks[0]).config
        if not cfg.num_moe_experts:
            raise ValueError("RoutingReplay: the model has no MoE layer; routing replay is for MoE models")
        self.num_layers, self.topk = cfg.num_layers, cfg.moe_router_topk
        self.sequence_parallel = bool(cfg.sequence_parallel)
        self._chunk_routers = {id(unwrap_model(c)): _routers(c) for c in model_chunks}
        for rs in self._chunk_routers.values():
            for _, r in rs:
                if r.router_replay is None:
                    raise ValueError("RoutingReplay: build the model with moe_enable_routing_replay=True")
        self._records: dict[int, list[torch.Tensor]] = {}
        self._hooks = [r.register_forward_hook(self._hook(layer))
                       for rs in self._chunk_routers.values() for layer, r in rs]
        self.recording = False

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            if self.recording:
                routing_map = output[1].detach()  # [tokens, experts] bool, exactly k per token (no token dropping)
                idx = routing_map.nonzero()[:, 1].view(routing_map.shape[0], -1)  # ascending per token
                self._records.setdefault(layer, []).append(idx)
        return hook

    def _all_routers(self) -> Iterable:
        for rs in self._chunk_routers.values():
            for _, r in rs:
                yield r.router_replay

    def begin(self, *, replay: bool, record: bool) -> None:
        """Start a forward_backward call: megatron's REPLAY_FORWARD action on every router when `replay`, else
        the routers' own top-k (megatron's action RECORD is not used: the hooks keep every micro batch)."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if ps.get_context_parallel_world_size() > 1:
            raise ValueError("routing replay (actor.router_replay.mode R2/R3) does not support context parallelism "
                             "(context_parallel_size > 1); set context_parallel_size=1")
        self._records = {}
        self.recording = record
        for rr in self._all_routers():
            rr.clear_indices()
            if replay:
                rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            else:
                rr.clear_router_replay_action()

    def set_replay(self, chunk, aligned: torch.Tensor) -> None:
        """Give the routers of `chunk` one micro batch's routing: `aligned` [b, S, L, k] in the left-aligned layout
        the model sees (parallel.forward), S the padded length.  Under sequence parallelism each TP rank takes its
        S / tp rows."""
        from megatron.core import parallel_state as ps

        b, S = aligned.shape[:2]
        seq = aligned.permute(1, 0, 2, 3)  # [S, b, L, k]: the routers' sequence-major token order
        if self.sequence_parallel:
            tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
            seq = seq[r * S // tp:(r + 1) * S // tp]
        flat = seq.reshape(-1, seq.shape[2], seq.shape[3])  # [tokens, L, k]
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for layer, router in self._chunk_routers[self._key(chunk)]:
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            router.router_replay.set_target_indices(flat[:, layer].long().contiguous())

    def after_forward(self, chunk) -> None:
        """After a replayed micro batch's forward on `chunk`: its routers switch to megatron's REPLAY_BACKWARD, so a
        full recompute in the backward takes each micro batch's routing from RouterReplay's queue in forward order
        (the order the pipeline schedules run the backwards in; verl's megatron_actor does the same).  The next
        :meth:`set_replay` switches them back."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for _, router in self._chunk_routers[self._key(chunk)]:
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    @staticmethod
    def _key(chunk) -> int:
        from parallel.convert import unwrap_model

        return id(unwrap_model(chunk))  # the same GPTModel whether the schedule gets it DDP-wrapped or not

    def end(self) -> None:
        """Clear megatron's replay state (targets and action) after a forward_backward call."""
        for rr in self._all_routers():
            rr.clear_indices()
            rr.clear_router_replay_action()
        self.recording = False

    def recorded(self, shifts: list[torch.Tensor], S: int) -> torch.Tensor:
        """What the routers chose in the last recorded call, as [B, S, L, k] :data:`ROUTING_DTYPE` in the caller's
        layout on every rank of the model (collective over the TP group under sequence parallelism and over the PP
        group); -1 for layers without a router.  `shifts`: each micro batch's leading-pad counts [b]
        (parallel.forward), in order; `S`: the caller's (unpadded) length."""
        from megatron.core import parallel_state as ps

        from parallel.forward import left_align

        device = next(iter(shifts)).device if shifts else torch.device("cpu")
        per_mb = []
        for i, sh in enumerate(shifts):
            b = sh.shape[0]
            layers = []
            for layer in range(self.num_layers):
                recs = self._records.get(layer)
                if recs is None:
                    layers.append(None)
                    continue
                idx = recs[i].to(device)  # [s_local * b, k]
                if self.sequence_parallel:
                    group = ps.get_tensor_model_parallel_group()
                    parts = [torch.empty_like(idx) for _ in range(dist.get_world_size(group))]
                    parts = [devices.to_group_device(p, group) for p in parts]
                    dist.all_gather(parts, devices.to_group_device(idx, group), group=group)
                    idx = torch.cat([p.to(device) for p in parts], 0)
                layers.append(idx.view(-1, b, self.topk).permute(1, 0, 2))  # [b, S_pad, k]
            S_pad = next((x.shape[1] for x in layers if x is not None), S)
            full = torch.stack([x if x is not None else torch.full((b, S_pad, self.topk), -1, device=device,
                                                                    dtype=torch.long) for x in layers], 2)
            per_mb.append(left_align(full, sh.to(device), inverse=True)[:, :S])
        out = torch.cat(per_mb, 0) if per_mb else torch.empty(0, S, self.num_layers, self.topk, dtype=torch.long)
        if ps.get_pipeline_model_parallel_world_size() > 1:  # each stage fills its layers; -1 elsewhere
            group = ps.get_pipeline_model_parallel_group()
            t = devices.to_group_device(out + 1, group)
            dist.all_reduce(t, group=group)
            out = t.to(device) - 1
        return out.to(ROUTING_DTYPE)

    def close(self) -> None:
        """Remove the recording hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

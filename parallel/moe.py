"""`moe/*` metrics of megatron-core MoE layers: router load-balancing loss and tokens per expert.

Usage (one per model, e.g. the actor):

    moe = MoEMetrics(bundle.chunks)        # attaches forward hooks to every router
    moe.reset()                            # before the training forward/backward passes
    ... forward_backward(...) ...
    metrics.update(moe.collect())          # collective over the model's parallel groups

Metrics (over the MoE layers of the whole model, all micro batches since `reset`):

* ``moe/load_balancing_loss``: the Switch-Transformer auxiliary loss (Fedus et al. 2021, eq. 4:
  E * sum_i f_i * P_i, 1 for a perfectly balanced router), unweighted by its coefficient, mean over
  layers and micro batches.  Read from megatron-core's aux-loss tracker, so it is only recorded
  for passes with gradients and a coefficient > 0 (megatron skips it otherwise).
* ``moe/tokens_per_expert_min`` / ``_max``: fewest / most token assignments any expert got in any
  layer (each token counts once per chosen expert: the counts of a layer sum to tokens * top-k).
* ``moe/expert_load_imbalance``: max over layers of (most-loaded expert / mean per expert); 1 is
  perfect balance, E / top-k the worst.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parallel import devices

AUX_LOSS_NAME = "load_balancing_loss"  # megatron-core's tracker key


class MoEMetrics:
    """Collects `moe/*` metrics from the routers of one model's chunks (see the module docstring); a pipeline stage
    without MoE layers (DeepSeek-V3's first dense layers) contributes nothing and gets the same values.

    Raises ValueError for a model without MoE layers.
    """

    def __init__(self, model_chunks):
        from parallel.convert import unwrap_model

        self._hooks, self._layers = [], []
        # the model's config, not a router's: a pipeline stage may hold no MoE layer (DeepSeek-V3's first dense
        # layers) and still takes part in every collective of `collect`
        self._config = unwrap_model(model_chunks[0]).config
        if not self._config.num_moe_experts:
            raise ValueError("MoEMetrics: the model has no MoE layer (no `mlp.router`); build it from a MoE config")
        for chunk in model_chunks:
            chunk = unwrap_model(chunk)
            for layer in chunk.decoder.layers:
                router = getattr(getattr(layer, "mlp", None), "router", None)
                if router is None:
                    continue
                self._layers.append(layer.layer_number - 1)
                self._hooks.append(router.register_forward_hook(self._make_hook(layer.layer_number - 1)))
        self.num_layers = self._config.num_layers
        self.num_experts = self._config.num_moe_experts
        self._counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)
        self._calls = torch.zeros(self.num_layers, dtype=torch.float64)

    def _make_hook(self, layer: int):
        def hook(module, inputs, output):
            routing_map = output[1]  # [tokens, experts] bool
            self._counts[layer] += routing_map.detach().sum(0).to("cpu", torch.float64)
            self._calls[layer] += 1

        return hook

    def reset(self) -> None:
        """Zero the token counts and megatron's aux-loss tracker."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        self._counts.zero_()
        self._calls.zero_()
        clear_aux_losses_tracker()

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        # CP ranks route different tokens: the data-parallel group with context parallelism
        for group in (ps.get_pipeline_model_parallel_group(), ps.get_data_parallel_group(with_context_parallel=True)):
            t = devices.to_group_device(t, group)
            dist.all_reduce(t, group=group)
        return t.cpu()

    def collect(self) -> dict[str, float]:
        """The `moe/*` metrics since the last `reset` (collective over PP and DP x CP groups; with
        sequence parallelism the TP ranks' token shards are summed too).  Same values on all ranks."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.moe_utils import (get_moe_layer_wise_logging_tracker,
                                                             reduce_aux_losses_tracker_across_ranks)

        counts = self._reduce(self._counts.clone())
        if self._config.sequence_parallel:
            counts = devices.to_group_device(counts, ps.get_tensor_model_parallel_group())
            dist.all_reduce(counts, group=ps.get_tensor_model_parallel_group())
            counts = counts.cpu()
        calls = self._reduce(self._calls.clone()) / ps.get_data_parallel_world_size(with_context_parallel=True)
        moe_layers = calls > 0
        out = {}
        if moe_layers.any():
            c = counts[moe_layers]
            out["moe/tokens_per_expert_min"] = float(c.min())
            out["moe/tokens_per_expert_max"] = float(c.max())
            mean = c.mean(1).clamp(min=1e-12)
            out["moe/expert_load_imbalance"] = float((c.max(1).values / mean).max())
        tracker = get_moe_layer_wise_logging_tracker()
        self._align_tracker(tracker)
        if AUX_LOSS_NAME in tracker:
            reduce_aux_losses_tracker_across_ranks([AUX_LOSS_NAME])
            values = tracker[AUX_LOSS_NAME]["values"].detach().double().cpu()
            if moe_layers.any() and values[moe_layers].abs().sum() > 0:
                out["moe/load_balancing_loss"] = float((values[moe_layers] / calls[moe_layers]).mean())
        return out

    def _align_tracker(self, tracker: dict) -> None:
        """Give this rank megatron's aux-loss tracker entry (zeros) when a pipeline peer has one and it has not: a
        stage without MoE layers records none, and megatron's reduction (reduce_aux_losses_tracker_across_ranks)
        is a collective over the pipeline group that every stage must enter.  The entry is the one megatron's
        router writes (values over all layers, reduced over this stage's tensor x context group)."""
        from megatron.core import parallel_state as ps

        pp = ps.get_pipeline_model_parallel_group()
        here = devices.to_group_device(torch.tensor([float(AUX_LOSS_NAME in tracker)]), pp)
        dist.all_reduce(here, op=dist.ReduceOp.MAX, group=pp)
        if here.item() and AUX_LOSS_NAME not in tracker:
            n = self._config.num_layers + (self._config.mtp_num_layers or 0)
            tracker[AUX_LOSS_NAME] = {"values": devices.to_group_device(torch.zeros(n), pp),
                                      "reduce_group": ps.get_tensor_and_context_parallel_group(), "avg_group": None,
                                      "reduce_group_has_dp": False}

    def close(self) -> None:
        """Remove the forward hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

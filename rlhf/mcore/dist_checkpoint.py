"""Training checkpoints with megatron-core `dist_checkpointing`: a checkpoint saved at one TP x PP
(x DP) layout loads at another.  Model and optimizer state are sharded tensors; small python
state (scheduler, RNG, KL controller, dataloader position) travels as common state.

Atomicity: the caller saves into `<dir>.tmp` and renames (see `rlhf.trainer` checkpointing);
`save_sharded` itself only writes.  Any script that saves must keep its work under
`if __name__ == "__main__":` (dist_checkpointing starts a spawn Manager that re-imports __main__).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from rlhf.mcore import cpu_patches  # noqa: F401
from rlhf.mcore.convert import unwrap_model


# The distributed optimizer's state is saved in the "fully_reshardable" format: it loads at any
# TP/PP/DP layout (the default flattened-range format is rejected by dist_checkpointing).
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def model_sharded_state_dict(chunks) -> dict:
    """{'model': sd} for one chunk, {'model0': sd0, 'model1': sd1, ...} for VPP chunks."""
    chunks = [unwrap_model(c) for c in chunks]
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def save_sharded(path: str, chunks, optimizer=None, common: dict | None = None) -> None:
    """Collective: write model (+ optimizer) sharded state and `common` python state to `path`."""
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    sd = model_sharded_state_dict(chunks)
    if optimizer is not None:
        sd["optimizer"] = optimizer.sharded_state_dict(dict(sd), is_loading=False, metadata=OPTIMIZER_METADATA)
    if common:
        sd["common_state"] = common
    dist_checkpointing.save(sd, path)
    dist.barrier()


def _init_empty_optimizer_state(optimizer) -> None:
    """Give a fresh (never stepped) optimizer zero Adam state and step 0, in place.

    Without Apex/Transformer Engine, megatron's DistributedOptimizer.state_dict() asserts that every
    param has a 'step' (it reads the single shared step), so loading a checkpoint into an optimizer
    that has not stepped yet fails. The values are overwritten by the load.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if len(state) == 0 and isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
                    state["exp_avg"] = torch.zeros_like(p.data)
                    state["exp_avg_sq"] = torch.zeros_like(p.data)
                    state["step"] = torch.tensor(0.0)


_PATCHED = False


def _patch_step_key_on_load() -> None:
    """Work around megatron-core 0.16.1 loading the distributed optimizer without Apex/TE.

    Without Apex or Transformer Engine (our CPU runs; GPU images without TE), DistributedOptimizer.
    load_state_dict first writes the shared 'step' into every param's state, then copies the
    fully-reshardable tensors {param, exp_avg, exp_avg_sq} over `{"param": p, **state}`, which
    now includes 'step' and raises KeyError. We set 'step' aside during that copy.
    """
    global _PATCHED
    if _PATCHED:
        return
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    orig = DistributedOptimizer._set_main_param_and_optimizer_states

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" in tensors:
            return orig(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        try:
            return orig(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    _PATCHED = True


def load_sharded(path: str, chunks, optimizer=None) -> dict:
    """Collective: load model (+ optimizer) state saved by `save_sharded` at any layout into
    `chunks`; returns the common python state. Raises FileNotFoundError if `path` is missing."""
    from megatron.core import dist_checkpointing

    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
    sd = model_sharded_state_dict(chunks)
    if optimizer is not None:
        _init_empty_optimizer_state(optimizer)
        _patch_step_key_on_load()
        sd["optimizer"] = optimizer.sharded_state_dict(dict(sd), is_loading=True, metadata=OPTIMIZER_METADATA)
    common = dist_checkpointing.load_common_state_dict(path)
    if "common_state" in common:
        sd["common_state"] = common["common_state"]
    loaded = dist_checkpointing.load(sd, path)
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for key, chunk in zip(keys, chunks):
        missing, unexpected = unwrap_model(chunk).load_state_dict(loaded[key], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing:
            raise RuntimeError(f"checkpoint {path!r} lacks model tensors {missing[:5]}...")
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    return loaded.get("common_state", {})

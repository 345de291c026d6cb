"""Training checkpoints with megatron-core `dist_checkpointing`: a checkpoint saved at one TP x PP
(x DP) layout loads at another.  Model and optimizer state are sharded tensors; small python
state (scheduler, RNG, KL controller, dataloader position) travels as common state.

Atomicity: the caller saves into `<dir>.tmp` and renames (see `rlhf.trainer` checkpointing);
`save_sharded` itself only writes.  Any script that saves must keep its work under
`if __name__ == "__main__":` (dist_checkpointing starts a spawn Manager that re-imports __main__).

Exact resume: the next step after `load_sharded` is bitwise the step of the uninterrupted run, with
or without the distributed optimizer (see `_unshare_step_tensors` for the megatron-core 0.16.1 bug
that made the distributed optimizer drift).

Slim saves (`slim=True`) keep only what resuming needs; see `save_sharded`.

No orphan writer: megatron-core 0.16.1 keeps its save results in a queue served by a spawned
multiprocessing Manager process that nothing stops when the trainer is killed (it was left running by
every killed run).  `save_sharded` gives megatron a queue from a Manager that dies with this process
(`_install_results_queue`).
"""
from __future__ import annotations

import os
from typing import Callable

import torch
import torch.distributed as dist

from parallel import cpu_patches  # noqa: F401
from parallel.convert import unwrap_model


# The distributed optimizer's state is saved in the "fully_reshardable" format: it loads at any
# TP/PP/DP layout (the default flattened-range format is rejected by dist_checkpointing).
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def model_sharded_state_dict(chunks) -> dict:
    """{'model': sd} for one chunk, {'model0': sd0, 'model1': sd1, ...} for VPP chunks."""
    chunks = [unwrap_model(c) for c in chunks]
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def save_sharded(path: str, chunks, optimizer=None, common: dict | None = None, slim: bool = False,
                 after_tensor_files: Callable[[str], None] | None = None) -> None:
    """Collective: write model (+ optimizer) sharded state and `common` python state to `path`.

    ``after_tensor_files(checkpoint_dir)``, if given, runs after this rank's tensor files are written and
    before megatron writes the checkpoint's metadata.json (the fault-injection tests kill the process there).

    slim=False (full): every model tensor of `chunks` and the complete optimizer state.
    slim=True: only what resuming needs.  Dropped: frozen parameters (requires_grad=False; on load
    they keep the values the model was built with, i.e. the base weights) and the distributed
    optimizer's fp32 main-parameter copy when the model itself is fp32 (it is bitwise the model
    weight, which is saved; on load it is restored from it).  Tied embedding/output weights are
    saved once in both modes (megatron-core keys the output layer as a replica of the embedding).
    With bf16/fp16 weights the fp32 main parameters are kept: they are not recomputable.
    """
    from megatron.core import dist_checkpointing

    _install_results_queue()
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    sd = model_sharded_state_dict(chunks)
    if slim:
        _drop_frozen(sd)
    if optimizer is not None:
        sd["optimizer"] = optimizer.sharded_state_dict(dict(sd), is_loading=False, metadata=OPTIMIZER_METADATA)
        if slim:
            _drop_main_param_copies(sd["optimizer"], optimizer)
    if common:
        sd["common_state"] = common
    sd[FORMAT_KEY] = {"slim": bool(slim)}
    dist_checkpointing.save(sd, path, sharded_strategy=_strategy_with_hook(after_tensor_files))
    dist.barrier()


def _install_results_queue() -> None:
    """Seed megatron's module-level save-results queue (filesystem_async._results_queue, created on the first
    save with ``mp.get_context("spawn").Manager().Queue()``) with the queue of a Manager whose server process
    gets SIGKILL when this process dies (parallel.lifetime).  Same queue type, same spawn context."""
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from parallel.lifetime import die_with_parent

    if filesystem_async._results_queue is not None:
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
    filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager (and its process) alive


def _strategy_with_hook(after_tensor_files):
    """None (megatron's default save strategy), or a copy of it that calls ``after_tensor_files(dir)`` after
    the tensor files are written and before megatron writes the checkpoint's metadata.json."""
    if after_tensor_files is None:
        return None
    import copy

    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    strategy = copy.copy(get_default_save_sharded_strategy())  # the default is a shared instance
    write = strategy.save

    def save(sharded_state_dict, checkpoint_dir):
        write(sharded_state_dict, checkpoint_dir)
        after_tensor_files(checkpoint_dir)

    strategy.save = save
    return strategy


FORMAT_KEY = "rlhf_save_format"


def _drop_frozen(sd: dict) -> None:
    """Remove frozen parameters (requires_grad=False) from a {'model': sharded_sd, ...} dict."""
    for part in sd.values():
        for key in [k for k, v in part.items()
                    if isinstance(getattr(v, "data", None), torch.nn.Parameter) and not v.data.requires_grad]:
            del part[key]


def _distopt_parts(optimizer, opt_sd) -> list:
    """[(DistributedOptimizer, its fully-reshardable sharded state), ...] for a (chained) optimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    parts = [opt_sd] if len(opts) == 1 else [opt_sd[i] for i in range(len(opts))]
    return [(o, p) for o, p in zip(opts, parts)
            if isinstance(o, DistributedOptimizer) and p.get("param_state_sharding_type") == "fully_reshardable"]


def _main_params_are_model_params(opt) -> bool:
    """fp32 weights: the distributed optimizer's main params are views of the model params."""
    return not (opt.config.bf16 or opt.config.fp16 or opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)


def _drop_main_param_copies(opt_sd, optimizer) -> None:
    for opt, part in _distopt_parts(optimizer, opt_sd):
        if _main_params_are_model_params(opt):
            for tensors in part["param_state"].values():
                tensors.pop("param", None)


def _restore_main_param_copies(loaded_opt, optimizer) -> None:
    """Slim load: give each param-state entry its 'param' back from the (already loaded) model
    weight it belongs to.  Entry i is the i-th parameter of the optimizer's grad buffers in
    `param_index_map` order, the order megatron uses to build and read the fully-reshardable state."""
    for opt, part in _distopt_parts(optimizer, loaded_opt):
        if not _main_params_are_model_params(opt):
            continue
        model_params = [p for buffer in opt.buffers for p in buffer.param_index_map]
        for idx, tensors in part["param_state"].items():
            tensors["param"] = model_params[idx].detach()


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


def _unshare_step_tensors(optimizer) -> None:
    """Give every parameter its own Adam 'step' tensor, in place.

    megatron-core 0.16.1 without Apex/TE: DistributedOptimizer.load_state_dict puts ONE step
    tensor into every parameter's state (`s["step"] = step` in a loop), and torch's Adam increments
    `state["step"]` in place per parameter, so the first step after a resume advanced the shared
    counter once per parameter: parameter i saw step s+i in its bias correction instead of s+1
    (the ~4e-4 drift of the resumed step).  Fresh runs are unaffected (torch allocates per param).
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for state in inner.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def fill_model(chunks, loaded: dict, path: str, left_out=frozenset()) -> None:
    """Copy the model parts of a loaded ``model_sharded_state_dict(chunks)`` into `chunks`; RuntimeError naming
    the tensors (other than `left_out` and ``_extra_state``) the checkpoint at `path` did not fill."""
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for key, chunk in zip(keys, chunks):
        missing, _ = unwrap_model(chunk).load_state_dict(loaded[key], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state") and k not in left_out]
        if missing:
            raise RuntimeError(f"checkpoint {path!r} lacks model tensors {missing[:5]}...")


def load_sharded(path: str, chunks, optimizer=None) -> dict:
    """Collective: load model (+ optimizer) state saved by `save_sharded` (full or slim) at any
    layout into `chunks`; returns the common python state. Raises FileNotFoundError if `path` is
    missing, RuntimeError if it lacks model tensors."""
    from megatron.core import dist_checkpointing

    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
    common = dist_checkpointing.load_common_state_dict(path)
    slim = bool(common.get(FORMAT_KEY, {}).get("slim", False))
    sd = model_sharded_state_dict(chunks)
    dropped = set()
    if slim:
        full_keys = {k for part in sd.values() for k in part}
        _drop_frozen(sd)
        dropped = full_keys - {k for part in sd.values() for k in part}
    if optimizer is not None:
        _init_empty_optimizer_state(optimizer)
        _patch_step_key_on_load()
        sd["optimizer"] = optimizer.sharded_state_dict(dict(sd), is_loading=True, metadata=OPTIMIZER_METADATA)
        if slim:
            _drop_main_param_copies(sd["optimizer"], optimizer)
    if "common_state" in common:
        sd["common_state"] = common["common_state"]
    loaded = dist_checkpointing.load(sd, path)
    fill_model(chunks, loaded, path, dropped)
    if optimizer is not None:
        if slim:
            _restore_main_param_copies(loaded["optimizer"], optimizer)
        optimizer.load_state_dict(loaded["optimizer"])
        _unshare_step_tensors(optimizer)
    return loaded.get("common_state", {})


"""Schema section ``rollout`` (the SGLang engines) and ``rollout.val_kwargs``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rlhf.config.choices import RolloutDtype, RolloutMode, RolloutName
from rlhf.config.schema.rules import SAMPLING, Checked, check, ge, ge1_or_null

__all__ = ["RolloutValConfig", "RolloutConfig"]
_T, _P, _K, _N = SAMPLING


@dataclass
class RolloutValConfig(Checked):
    temperature: float = check(0.0, *_T)
    top_p: float = check(1.0, *_P)
    top_k: int = check(-1, *_K)
    n: int = check(1, *_N)


@dataclass
class RolloutConfig(Checked):
    name: RolloutName = RolloutName.sglang
    mode: RolloutMode = RolloutMode.colocated
    tensor_model_parallel_size: int = ge(1, 1)
    num_engines: int = ge(1, 1)
    n: int = check(1, *_N)  # ppo_trainer.yaml: 4 for GROUP_ESTIMATORS unless a recipe or override sets it
    temperature: float = check(1.0, *_T)
    top_p: float = check(1.0, *_P)
    top_k: int = check(-1, *_K)
    # also settable as verl's rollout.gpu_memory_utilization
    mem_fraction_static: float = check(0.5, lambda v: 0 < v < 1, "must be in (0, 1) (fraction of device memory for "
                                       "SGLang's weights + KV cache; ~0.5 when colocated with the trainer)")
    # SGLang's memory saver: colocated engines free their weights and KV cache while the trainer computes
    # (release / resume).  null: on with CUDA; ignored on CPU (the CPU engine has no memory saver)
    enable_memory_saver: Optional[bool] = None
    dtype: RolloutDtype = RolloutDtype.auto  # auto: model.dtype (rlhf.rollout.engine_args.resolve_engine_dtype)
    # KV-cache tokens of each engine (an upper bound: SGLang keeps less if its memory profile says so); null:
    # sized to the batch an engine serves (rlhf.rollout.engine_args.batch_kv_tokens)
    max_total_tokens: Optional[int] = ge1_or_null(None, "null sizes the KV cache to the rollout batch")
    max_restarts: int = ge(0, 2)
    weight_sync_bucket_mb: int = ge(1, 512)
    weight_sync_check: bool = False
    # disaggregated weight sync: the address the engines dial to join each stage leader's weight-update group.
    # null: the IP of the leader's outward interface; "iface:<name>" (e.g. iface:ib0): that interface's IPv4 on
    # each leader; an IP or host name: used as is (one trainer node).  Set it on multi-homed hosts.
    weight_update_address: Optional[str] = None
    val_kwargs: RolloutValConfig = field(default_factory=RolloutValConfig)

"""Weight sync: the actor's megatron shards -> SGLang engines (bridge.py's docstring walks through one sync)."""
from rlhf.weight_bridge.bridge import CheckReport, SyncStats, WeightBridge, WeightSyncConfig
from rlhf.weight_bridge.plan import (SendPlan, WeightBridgeError, normalize_expected, plan_local_tensors,
                                     regex_name_map, validate_against_expected)
from rlhf.weight_bridge.topology import MegatronTopology

__all__ = ["WeightBridge", "WeightSyncConfig", "SyncStats", "CheckReport", "WeightBridgeError", "SendPlan",
           "plan_local_tensors", "regex_name_map", "MegatronTopology", "normalize_expected",
           "validate_against_expected"]

"""Weight sync: the actor's megatron shards -> SGLang engines (plan, validate, gather -> convert -> bucket, send).

bridge.py runs one sync (:class:`WeightBridge`, configured by :class:`WeightSyncConfig`); plan.py builds and checks
the send plan; hf_stream.py gathers and converts; bucketing.py lays out buckets; delivery.py is the per-bucket
protocol of the two transports, from_tensor.py and from_distributed.py; sessions.py opens and closes the engines'
weight-update sessions; check.py reads weights back.
"""
from rlhf.weight_bridge.bridge import SyncStats, WeightBridge, WeightSyncConfig
from rlhf.weight_bridge.check import CheckReport
from rlhf.weight_bridge.plan import (SendPlan, WeightBridgeError, normalize_expected, plan_local_tensors,
                                     regex_name_map, validate_against_expected)
from rlhf.weight_bridge.topology import MegatronTopology

__all__ = ["WeightBridge", "WeightSyncConfig", "SyncStats", "CheckReport", "WeightBridgeError", "SendPlan",
           "plan_local_tensors", "regex_name_map", "MegatronTopology", "normalize_expected",
           "validate_against_expected"]

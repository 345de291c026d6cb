"""Weight sync: the actor's megatron shards -> SGLang engines (plan, validate, gather -> convert -> bucket, send).

bridge.py runs one sync (:class:`WeightBridge`, configured by :class:`WeightSyncConfig`); plan.py / validate.py
build and check the send plan; hf_stream.py gathers and converts; bucketing.py lays out buckets; from_tensor.py
(with local_handles.py) and from_distributed.py are the two transports; sessions.py opens and closes the engines'
weight-update sessions; check.py reads weights back.
"""
from rlhf.weight_bridge.bridge import SyncStats, WeightBridge, WeightSyncConfig
from rlhf.weight_bridge.check import CheckReport
from rlhf.weight_bridge.plan import SendPlan, local_entries, plan_local_tensors, regex_name_map
from rlhf.weight_bridge.topology import MegatronTopology
from rlhf.weight_bridge.validate import WeightBridgeError, normalize_expected, validate_against_expected

__all__ = ["WeightBridge", "WeightSyncConfig", "SyncStats", "CheckReport", "WeightBridgeError", "SendPlan",
           "local_entries", "plan_local_tensors", "regex_name_map", "MegatronTopology", "normalize_expected",
           "validate_against_expected"]

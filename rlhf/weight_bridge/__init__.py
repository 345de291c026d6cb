"""Weight sync: the actor's megatron shards -> SGLang engines (plan, validate, bucket, deliver).

bridge.py orchestrates one sync (:class:`WeightBridge`); plan.py / validate.py build and check the send
plan; shm_buckets.py is the single-copy path (every TP rank writes its shard into a shared bucket),
hf_stream.py the gather-and-convert path; from_tensor.py and
from_distributed.py are the two transports; check.py reads weights back; bucketing.py lays out buckets.
"""
from rlhf.weight_bridge.bridge import SyncStats, WeightBridge
from rlhf.weight_bridge.check import CheckReport
from rlhf.weight_bridge.plan import SendPlan, local_entries, plan_local_tensors, regex_name_map
from rlhf.weight_bridge.topology import MegatronTopology
from rlhf.weight_bridge.validate import WeightBridgeError, normalize_expected, validate_against_expected

__all__ = ["WeightBridge", "SyncStats", "CheckReport", "WeightBridgeError", "SendPlan", "local_entries",
           "plan_local_tensors", "regex_name_map", "MegatronTopology", "normalize_expected",
           "validate_against_expected"]

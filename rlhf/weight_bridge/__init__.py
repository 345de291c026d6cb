"""Weight sync: the actor's megatron shards -> SGLang engines (bridge.py's docstring walks through one sync)."""
from rlhf.weight_bridge.bridge import SyncStats, WeightBridge, WeightSyncConfig
from rlhf.weight_bridge.plan import WeightBridgeError, normalize_expected, regex_name_map, validate_against_expected

__all__ = ["WeightBridge", "WeightSyncConfig", "SyncStats", "WeightBridgeError", "regex_name_map",
           "normalize_expected", "validate_against_expected"]

"""Weight sync: the actor's megatron shards -> SGLang engines (plan, validate, bucket, deliver)."""
from rlhf.mcore.weight_sync.bridge import *  # noqa: F401,F403
from rlhf.mcore.weight_sync.bridge import __all__  # noqa: F401

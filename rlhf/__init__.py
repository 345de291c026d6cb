"""RLHF post-training on megatron-core with SGLang rollouts.  `from rlhf import Trainer` (rlhf/api.py)."""

__version__ = "0.1.0"


def __getattr__(name):
    if name == "Trainer":  # lazy: `import rlhf` stays light
        from rlhf.api import Trainer

        return Trainer
    raise AttributeError(f"module 'rlhf' has no attribute {name!r}")

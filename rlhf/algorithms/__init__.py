"""PPO-family algorithm functions (pure torch), verl ``core_algos`` API.

Modules: registry (estimator / policy-loss registries), advantages (GAE,
REINFORCE++, ReMax), group_advantages (GRPO, RLOO, REINFORCE++-baseline, OPO),
group_variants (GPG, pass@k GRPO), losses (aggregation, PPO / value / entropy
losses), policy_losses (vanilla, GSPO, SAPO, GPG, CISPO, GMPO), cov_losses
(Clip-Cov, KL-Cov), kl (KL estimators and controllers), masked_ops, dapo,
dpo (DPO / IPO / hinge), config_access (reading verl-style configs).
The registries are forwarded by reference, as in :mod:`rlhf.algorithms.core_algos`.
"""

from rlhf.algorithms import _forwarding
from rlhf.algorithms.core_algos import *  # noqa: F401,F403
from rlhf.algorithms.core_algos import __all__ as _core_all
from rlhf.algorithms.dpo import DPO_LOSS_TYPES, compute_dpo_loss

# The star import copied the registries; drop the copies so reads and writes forward to registry.py.
del ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY  # noqa: F821
__getattr__ = _forwarding.forwarded_getattr(__name__)
_forwarding.install(__name__)

__all__ = [*_core_all, "DPO_LOSS_TYPES", "compute_dpo_loss"]

"""Rewards: rule-based scorers (GSM8K), a data_source-keyed registry, and the
reward-model interface.

Public API::

    compute_score, extract_solution          # rlhf.rewards.gsm8k
    register_reward_fn, get_reward_fn, registered_data_sources,
    load_custom_reward_fn, compute_scores, call_reward_fn   # rlhf.rewards.registry
    RewardModelScorer, HFRewardModelScorer, RayRewardModelScorer   # rlhf.rewards.reward_model
    RewardManager, build_reward_manager       # rlhf.rewards.manager (weighted sources, fallbacks, validity)
    Fallback                                  # rlhf.rewards.fallback (rule / static / constant fallback scores)
    run_with_timeouts, call_with_timeout      # rlhf.rewards.timeout
"""

from .gsm8k import compute_score, extract_solution
from .registry import (
    ARITHMETIC_DATA_SOURCE,
    call_reward_fn,
    compute_scores,
    get_reward_fn,
    load_custom_reward_fn,
    register_reward_fn,
    registered_data_sources,
)
from .reward_model import HFRewardModelScorer, RayRewardModelScorer, RewardModelScorer, check_scores
from .fallback import Fallback
from .manager import (RewardManager, RewardSource, RewardSources, build_reward_manager, build_reward_sources,
                      check_reward_config)
from .timeout import call_with_timeout, run_with_timeouts

__all__ = [
    "compute_score",
    "extract_solution",
    "register_reward_fn",
    "get_reward_fn",
    "registered_data_sources",
    "load_custom_reward_fn",
    "compute_scores",
    "call_reward_fn",
    "ARITHMETIC_DATA_SOURCE",
    "RewardModelScorer",
    "HFRewardModelScorer",
    "RayRewardModelScorer",
    "RewardSource",
    "RewardManager",
    "build_reward_manager",
    "RewardSources",
    "build_reward_sources",
    "check_reward_config",
    "Fallback",
    "run_with_timeouts",
    "call_with_timeout",
    "check_scores",
]

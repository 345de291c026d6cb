"""Rewards: rule-based scorers (GSM8K), a data_source-keyed registry, and the
reward-model interface.

Public API::

    compute_score, extract_solution          # rlhf.rewards.gsm8k
    register_reward_fn, get_reward_fn, registered_data_sources,
    load_custom_reward_fn, compute_scores, call_reward_fn   # rlhf.rewards.registry
    RewardModelScorer, HFRewardModelScorer, RayRewardModelScorer   # rlhf.rewards.reward_model
    RewardSources, build_reward_sources       # rlhf.rewards.sources (weighted sources, fallbacks)
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
from .sources import RewardSource, RewardSources, build_reward_sources

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
    "RewardSources",
    "build_reward_sources",
    "check_scores",
]

"""Rewards: rule-based scorers (GSM8K), a data_source-keyed registry, and the
reward-model interface.

Public API::

    compute_score, extract_solution          # rlhf.rewards.gsm8k
    register_reward_fn, get_reward_fn, registered_data_sources,
    load_custom_reward_fn, compute_scores, call_reward_fn   # rlhf.rewards.registry
    RewardModelScorer                         # rlhf.rewards.reward_model
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
from .reward_model import RewardModelScorer, check_scores

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
    "check_scores",
]

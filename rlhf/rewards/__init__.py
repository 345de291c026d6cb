"""Rewards: rule-based scorers keyed by data_source (verl's names and return values), a data_source-keyed
registry, and the reward-model interface.

Rule rewards (one module per family, each registering its verl data-source names)::

    gsm8k.py        openai/gsm8k, gsm8k (and the quickstart's synthetic/arithmetic)
    math_answers.py lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500 (last \\boxed{},
                    math-verify equivalence through math_check.py; float)
    dapo.py         math_dapo, math, math_dapo_reasoning, aime* (last "Answer:" line; {"score": +-1.0, "acc", "pred"})
    markdown.py     markdown bold around answers read as the plain answer (every family above and below)
    prime_math.py   numina_aops_forum, numina_synthetic_math, numina_amc_aime, numina_synthetic_amc, numina_cn_k12,
                    numina_olympiads (PRIME answer matching, math-verify equivalence; float)
    geo3k.py        hiyouga/geometry3k (0.9 x accuracy + 0.1 x format; float)
    qa.py           searchR1_nq, ..., nq, triviaqa, popqa, hotpotqa, 2wikimultihopqa, musique, bamboogle (EM; float)
    code_sources.py codecontests, apps, codeforces, taco, ...: refused (code execution needs a sandbox)

Public API::

    compute_score, extract_solution          # rlhf.rewards.gsm8k
    register_reward_fn, register_reward_prefix, get_reward_fn, registered_data_sources,
    UnsupportedDataSourceError, load_custom_reward_fn, compute_scores, call_reward_fn   # rlhf.rewards.registry
    math_equal                                # rlhf.rewards.math_check (math-verify, time-limited)
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
    register_reward_prefix,
    registered_data_sources,
    UnsupportedDataSourceError,
)
from . import code_sources, dapo, geo3k, math_answers, prime_math, qa  # noqa: F401 - they register their sources
from .math_check import math_equal
from .reward_model import HFRewardModelScorer, RayRewardModelScorer, RewardModelScorer, check_scores
from .fallback import Fallback
from .manager import (RewardManager, RewardSource, RewardSources, build_reward_manager, build_reward_sources,
                      check_reward_config)
from .timeout import call_with_timeout, run_with_timeouts

__all__ = [
    "compute_score",
    "extract_solution",
    "register_reward_fn",
    "register_reward_prefix",
    "UnsupportedDataSourceError",
    "math_equal",
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

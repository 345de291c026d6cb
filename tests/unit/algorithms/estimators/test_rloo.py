"""RLOO's leave-one-out baseline (rlhf/algorithms/estimators/rloo.py) by hand.

Expected numbers are worked out in comments or with plain python, never by the function under test.
"""

import torch

from rlhf.algorithms import compute_rloo_outcome_advantage
from tests.unit.algorithms.helpers import outcome_rewards, t


# ----------------------------------------------------------------- RLOO

def test_rloo_leave_one_out_numbers():
    scores, index = [3.0, 1.0, 2.0, 4.0], ["g", "g", "g", "solo"]
    rewards, mask = outcome_rewards(scores, [2, 1, 3, 2], width=3)
    adv, _ = compute_rloo_outcome_advantage(rewards, mask, index)
    # 3 - mean(1, 2) = 1.5; 1 - mean(3, 2) = -1.5; 2 - mean(3, 1) = 0; singleton keeps its score
    per_seq = [1.5, -1.5, 0.0, 4.0]
    torch.testing.assert_close(adv, t([[s] * n + [0.0] * (3 - n) for s, n in zip(per_seq, [2, 1, 3, 2])]))


def test_rloo_matches_explicit_loop():
    scores = [0.2, 0.9, -0.4, 1.5, 0.0, 0.7]
    index = [0, 1, 0, 1, 0, 1]
    rewards, mask = outcome_rewards(scores, [1] * 6, width=1)
    adv, _ = compute_rloo_outcome_advantage(rewards, mask, index)
    expected = []
    for i, (s, g) in enumerate(zip(scores, index)):
        others = [scores[j] for j in range(6) if index[j] == g and j != i]
        expected.append([s - sum(others) / len(others)])
    torch.testing.assert_close(adv, t(expected))

"""On-policy distillation's per-token signal (rlhf.algorithms.distill) against hand-computed values:
d_t = log pi_student(a_t) - log pi_teacher(a_t) (the k1 estimate of KL(student || teacher)) and
A_hat_t = A_t - kl_coef x d_t on response tokens (slime's apply_opd_kl_to_advantages)."""
from __future__ import annotations

import math

import pytest
import torch

from rlhf.algorithms.distill import apply_opd_to_advantages, opd_metrics, opd_reverse_kl

# two responses of 3 tokens, the second one 2 tokens long (last position padding, holding NaN)
STUDENT = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -3.0, float("nan")]])
TEACHER = torch.tensor([[-1.5, -0.25, -2.0], [-0.6, -1.0, -7.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
ADV = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, 9.0]])


def test_reverse_kl_is_student_minus_teacher_on_response_tokens():
    d = opd_reverse_kl(STUDENT, TEACHER, MASK)
    assert d.tolist() == [[1.0, -0.75, 0.0], [0.5, -2.0, 0.0]]  # padding (NaN in the student) -> 0


def test_advantages_minus_kl_coef_times_reverse_kl():
    d = opd_reverse_kl(STUDENT, TEACHER, MASK)
    out = apply_opd_to_advantages(ADV, d, MASK, kl_coef=0.5)
    # 1 - 0.5*1 = 0.5; 1 + 0.5*0.75 = 1.375; 1 - 0 = 1; -0.5 - 0.25 = -0.75; -0.5 + 1 = 0.5; padding 0
    assert out.tolist() == [[0.5, 1.375, 1.0], [-0.75, 0.5, 0.0]]
    pure = apply_opd_to_advantages(ADV, d, MASK, kl_coef=2.0, task_reward=False)
    assert pure.tolist() == [[-2.0, 1.5, 0.0], [-1.0, 4.0, 0.0]]  # -2 d, the task advantages ignored
    with pytest.raises(ValueError, match="distill.kl_coef=-1"):
        apply_opd_to_advantages(ADV, d, MASK, kl_coef=-1)
    with pytest.raises(ValueError, match="shape mismatch"):
        apply_opd_to_advantages(ADV[:, :2], d, MASK, kl_coef=1)


def test_metrics_are_token_means_over_the_response():
    d = opd_reverse_kl(STUDENT, TEACHER, MASK)
    m = opd_metrics(STUDENT, TEACHER, d, MASK, kl_coef=0.5)
    assert m["distill/reverse_kl"] == pytest.approx((1.0 - 0.75 + 0.0 + 0.5 - 2.0) / 5)  # -0.25
    assert m["distill/reverse_kl_max"] == 1.0 and m["distill/reverse_kl_min"] == -2.0
    assert m["distill/reverse_kl_seq"] == pytest.approx((0.25 + -1.5) / 2)  # per-response sums, averaged
    assert m["distill/teacher_logprob"] == pytest.approx((-1.5 - 0.25 - 2.0 - 0.6 - 1.0) / 5)
    assert m["distill/student_logprob"] == pytest.approx((-0.5 - 1.0 - 2.0 - 0.1 - 3.0) / 5)
    assert m["distill/kl_coef"] == 0.5
    assert all(math.isfinite(v) for v in m.values())


def test_sampled_estimate_is_unbiased_for_the_reverse_kl():
    """Averaged over tokens drawn from the student, d_t estimates KL(student || teacher) of the two distributions."""
    g = torch.Generator().manual_seed(0)
    student = torch.log_softmax(torch.tensor([2.0, 0.5, -1.0, 0.0]), -1)
    teacher = torch.log_softmax(torch.tensor([0.0, 1.5, 0.0, -2.0]), -1)
    exact = float((student.exp() * (student - teacher)).sum())
    tokens = torch.multinomial(student.exp(), 200_000, replacement=True, generator=g)
    d = opd_reverse_kl(student[tokens][None], teacher[tokens][None], torch.ones(1, tokens.numel()))
    assert float(d.mean()) == pytest.approx(exact, abs=0.01)

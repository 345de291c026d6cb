"""KL penalties: the estimators, the KL-coefficient controllers and the in-reward KL penalty.

Estimators follow John Schulman, "Approximating KL Divergence" (2020),
http://joschu.net/blog/kl-approx.html, written for KL(pi || pi_ref) with
samples drawn from pi and ``log_ratio = logprob - ref_logprob``:

* k1 ("kl"):          log_ratio                          grad wrt logprob: 1
* "abs":              |log_ratio|                        grad: sign(log_ratio)
* k2 ("mse"):         0.5 * log_ratio**2                 grad: log_ratio
* k3 ("low_var_kl"):  exp(-log_ratio) + log_ratio - 1    grad: 1 - exp(ref_logprob - logprob)

A "+" suffix (e.g. "k3+") returns the forward value of the named estimator
with the gradient of k2 (straight-through), as in verl: k1/k3 are unbiased
for the KL value but not for its gradient, while k2's gradient is.
"""

from typing import Any, Optional, Union

import numpy as np
import torch

from rlhf.algorithms._validation import check_2d, check_same_shape
from rlhf.algorithms.config_access import config_get
from rlhf.algorithms.masked_ops import masked_mean, masked_sum
from rlhf.algorithms.registry import KL_CTRL_TYPES, KL_PENALTY_TYPES

# log-ratio clamp before exp() and output clamp of the k3 estimator (verl values).
_K3_LOG_RATIO_CLAMP = 20.0
_K3_VALUE_CLAMP = 10.0


def _kl_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "full":
        raise NotImplementedError("kl_penalty='full' needs full-vocabulary distributions and is not implemented")
    estimator = KL_PENALTY_TYPES.get(mode)
    if estimator is None:
        valid = sorted(KL_PENALTY_TYPES) + [m + "+" for m in sorted(KL_PENALTY_TYPES)]
        raise ValueError(f"unknown kl_penalty {mode!r}; valid: {valid}")
    log_ratio = logprob - ref_logprob
    if estimator == "k1":
        return log_ratio
    if estimator == "abs":
        return log_ratio.abs()
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    ref_minus_log = torch.clamp(-log_ratio, min=-_K3_LOG_RATIO_CLAMP, max=_K3_LOG_RATIO_CLAMP)
    k3 = torch.exp(ref_minus_log) - ref_minus_log - 1
    return torch.clamp(k3, min=-_K3_VALUE_CLAMP, max=_K3_VALUE_CLAMP)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs.

    Args:
        logprob: log pi(a_t | s_t) of the sampled tokens, nats, shape (bs, response_length)
            (any shape is accepted as long as both inputs match).
        ref_logprob: log pi_ref(a_t | s_t), same shape.
        kl_penalty: "kl"/"k1", "abs", "mse"/"k2", "low_var_kl"/"k3" (clamped to
            [-10, 10] like verl), optionally with a "+" suffix for the k2
            straight-through gradient; "full" raises NotImplementedError.

    Returns:
        Per-token KL estimate in nats, same shape as the inputs.

    Raises:
        ValueError: shape mismatch or unknown mode.
        NotImplementedError: mode "full".
    """
    check_same_shape(logprob=logprob, ref_logprob=ref_logprob)
    straight_through = kl_penalty.endswith("+")
    mode = kl_penalty[:-1] if straight_through else kl_penalty
    forward = _kl_forward(logprob, ref_logprob, mode)
    if not straight_through:
        return forward
    k2 = 0.5 * (logprob - ref_logprob).square()
    return k2 - k2.detach() + forward.detach()


# ``apply_kl_penalty`` takes a parameter named ``kl_penalty`` (verl's name) that
# shadows the function inside its body; this private alias keeps it reachable.
_kl_penalty = kl_penalty


class FixedKLController:
    """Constant KL coefficient; ``update`` is a no-op.

    Attributes:
        value: the coefficient beta used in ``reward - beta * KL``.
    """

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (kept for interface parity with AdaptiveKLController)."""

    def state_dict(self) -> dict:
        """Checkpointable state: ``{"value": beta}``."""
        return {"value": self.value}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the state produced by :meth:`state_dict`."""
        self.value = float(state_dict["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019, "Fine-Tuning Language
    Models from Human Preferences" (arXiv:1909.08593), section 2.2:

        e_t = clip(KL_t / KL_target - 1, -0.2, 0.2)
        beta_{t+1} = beta_t * (1 + K_beta * e_t),   K_beta = n_steps / horizon

    KL_t is the KL of whole responses (the paper's KL(pi, rho) of the policy's
    output distribution), so beta grows while responses drift further than
    ``target_kl`` nats from the reference and shrinks otherwise.

    Args:
        init_kl_coef: initial beta.
        target_kl: target KL in nats (must be > 0).
        horizon: adaptation horizon in samples (must be > 0).

    Raises:
        ValueError: non-positive ``target_kl`` or ``horizon``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Multiply ``value`` by ``1 + clip(current_kl/target - 1, -0.2, 0.2) * n_steps / horizon``.

        Args:
            current_kl: measured KL of the latest batch (nats, python float); Ziegler et al.
                define it on whole responses, so :func:`apply_kl_penalty` passes the mean
                sequence KL and ``target_kl`` is a per-response target.
            n_steps: number of samples in that batch.
        """
        proportional_error = float(np.clip(current_kl / self.target - 1, -0.2, 0.2))
        self.value *= 1 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict:
        """Checkpointable state: current value, target and horizon."""
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the state produced by :meth:`state_dict`."""
        self.value = float(state_dict["value"])
        self.target = float(state_dict.get("target", self.target))
        self.horizon = float(state_dict.get("horizon", self.horizon))


KLController = Union[FixedKLController, AdaptiveKLController]


def get_kl_controller(
    kl_ctrl: Any, kl_coef: Optional[float] = None, target_kl: Optional[float] = None, horizon: Optional[float] = None
) -> KLController:
    """Build a KL controller from a config (verl: ``get_kl_controller(config.algorithm.kl_ctrl)``,
    fields ``type``, ``kl_coef``, ``target_kl``, ``horizon``) or, as before, from separate
    arguments ``get_kl_controller("adaptive", kl_coef, target_kl, horizon)``.

    ``"fixed"`` -> FixedKLController(kl_coef); ``"adaptive"`` -> AdaptiveKLController(kl_coef,
    target_kl, horizon), whose target is a SEQUENCE KL (see :func:`apply_kl_penalty`).

    Raises:
        ValueError: unknown type, or missing / non-positive ``target_kl`` / ``horizon``
            for the adaptive controller.
    """
    if isinstance(kl_ctrl, str):
        kl_ctrl_type = kl_ctrl
    else:
        kl_ctrl_type = config_get(kl_ctrl, "type", "fixed")
        kl_coef = config_get(kl_ctrl, "kl_coef", 0.001)
        target_kl, horizon = config_get(kl_ctrl, "target_kl"), config_get(kl_ctrl, "horizon")
    if kl_ctrl_type == "fixed":
        return FixedKLController(kl_coef=kl_coef)
    if kl_ctrl_type == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("adaptive KL controller needs target_kl and horizon (algorithm.kl_ctrl.*)")
        return AdaptiveKLController(init_kl_coef=kl_coef, target_kl=target_kl, horizon=horizon)
    raise ValueError(f"unknown kl_ctrl type {kl_ctrl_type!r}; valid: {list(KL_CTRL_TYPES)}")


def sequence_kl(kld: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """KL of each whole response, sum_t mask_t * kld_t (nats), shape (bs,): the KL
    between the response distributions, which Ziegler et al. 2019 control."""
    return masked_sum(kld, response_mask, axis=-1)


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: KLController,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, dict]:
    """Subtract a per-token KL penalty from the rewards (Ziegler et al. 2019, eq. 2;
    Ouyang et al. 2022, eq. 2):  r_t = score_t - beta * KL_t.

    The controller is then updated in place, with ``n_steps = bs``, on the batch mean of
    the SEQUENCE KL ``sum_t KL_t`` (:func:`sequence_kl`): Ziegler et al.'s adaptive
    controller (sec. 2.2) targets KL(pi, rho) of whole responses.  (verl feeds the
    token-mean KL, so beta can shrink while the sequence KL is above target whenever
    responses are longer than target/token-KL.)  The reported coefficient is the beta
    that was applied, i.e. the value *before* the update.

    Args:
        token_level_scores: reward-model scores per token, shape (bs, response_length).
        old_log_probs: rollout-policy log-probs of the sampled tokens, nats, same shape.
        ref_log_probs: reference-policy log-probs, nats, same shape.
        response_mask: 1 for response tokens, 0 for padding, same shape.
        kl_ctrl: FixedKLController or AdaptiveKLController.
        kl_penalty: estimator name, see :func:`kl_penalty`.

    Returns:
        token_level_rewards: same shape; equals the scores at masked positions.
        metrics: ``actor/reward_kl_penalty`` (token-mean KL, mean over sequences, as
            verl), ``actor/reward_kl_penalty_seq`` (mean sequence KL, what the controller
            sees), ``actor/reward_kl_penalty_coeff`` (beta applied); python floats.

    Raises:
        ValueError: shape mismatch or non-2D inputs.
    """
    check_2d("token_level_scores", token_level_scores)
    check_same_shape(
        token_level_scores=token_level_scores,
        old_log_probs=old_log_probs,
        ref_log_probs=ref_log_probs,
        response_mask=response_mask,
    )
    valid = response_mask != 0
    kld = _kl_penalty(old_log_probs, ref_log_probs, kl_penalty)
    kld = torch.where(valid, kld, torch.zeros_like(kld))
    beta = kl_ctrl.value
    token_level_rewards = torch.where(valid, token_level_scores - beta * kld, token_level_scores)

    token_mean_kl = masked_mean(kld, response_mask, axis=-1).mean().item()
    seq_kl = sequence_kl(kld, response_mask).mean().item()
    kl_ctrl.update(current_kl=seq_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": token_mean_kl, "actor/reward_kl_penalty_seq": seq_kl,
               "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics

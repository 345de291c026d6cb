"""The config's fixed choices as Enums (OmegaConf checks a value against an Enum field's members while composing;
each Enum's docstring is the hint after the allowed values), and the message for a value that is not one of them."""
from __future__ import annotations

from enum import Enum, StrEnum
from typing import Any, Optional, Sequence, Union

# the algorithms' names, defined once in rlhf.algorithms.registry (torch-free); GROUP_ESTIMATORS re-exported
from rlhf.algorithms.registry import GROUP_ESTIMATORS, KL_CTRL_TYPES, KL_PENALTY_TYPES, LOSS_AGG_MODES  # noqa: F401


class Choice(StrEnum):
    """A member is its value as a string and pickles as a plain ``str`` (a Ray actor needs no rlhf.config)."""

    def __reduce_ex__(self, protocol: Any) -> tuple:
        return str, (self.value,)


def _choices(name: str, members: str, hint: str) -> type[Choice]:
    enum = Choice(name, [(m, m) for m in members.split()], module=__name__)
    enum.__doc__ = hint
    return enum


ModelDtype = _choices("ModelDtype", "float32 bfloat16", "bfloat16 on GPU, float32 on CPU")
Recompute = _choices("Recompute", "full selective", "null (off), full or selective")
RolloutName = _choices("RolloutName", "sglang", "SGLang is the rollout engine")
RolloutMode = _choices("RolloutMode", "colocated disaggregated", "colocated: engines share the trainer's devices; "
                       "disaggregated: engines on devices of their own")
RolloutDtype = _choices("RolloutDtype", "auto float32 bfloat16 float16",
                        "auto follows model.dtype (the engines run in the actor's training dtype)")
AlgorithmName = _choices("AlgorithmName", "ppo dpo", "ppo (also for the critic-free estimators grpo, rloo, ...) "
                         "or dpo")
KLControlType = _choices("KLControlType", " ".join(KL_CTRL_TYPES), "fixed keeps kl_coef, adaptive steers it to "
                         "target_kl")
ResumeMode = _choices("ResumeMode", "auto disable resume_path", "auto resumes from the latest checkpoint in "
                      "trainer.default_local_dir, disable starts fresh, resume_path loads trainer.resume_from_path")
LoggerBackend = _choices("LoggerBackend", "console tensorboard wandb mlflow",
                         "a list, e.g. trainer.logger=[console,tensorboard], or one name (trainer.logger=console)")
Truncation = _choices("Truncation", "error left right middle", "what to do with a prompt longer than "
                      "data.max_prompt_length when data.filter_overlong_prompts=false: error stops, left keeps its "
                      "last tokens, right its first, middle both ends")
Gsm8kMethod = _choices("Gsm8kMethod", "strict flexible", "strict: the answer after '####'; flexible: the last "
                       "number of the response")
LossAggMode = _choices("LossAggMode", " ".join(LOSS_AGG_MODES), "how rlhf.algorithms.agg_loss averages the "
                       "per-token loss")
#: estimators of rlhf.algorithms.kl_penalty; a "+" suffix: that value with k2's gradient (straight-through)
KLEstimator = _choices("KLEstimator", " ".join([*KL_PENALTY_TYPES, *(k + "+" for k in KL_PENALTY_TYPES)]),
                       "k1 (kl), abs, k2 (mse), k3 (low_var_kl), each also with '+' (the k2 gradient)")


def choice_problem(key: str, value: Any, choices: Union[type[Enum], Sequence[str]], optional: bool = False,
                   hint: Optional[str] = None) -> str:
    """``"key='bad' is not one of [a, b] (did you mean key=a?); <hint>."``; ``choices`` is an Enum type (its
    members' names; the default hint is its docstring) or a list of names."""
    import difflib

    names = list(choices.__members__) if isinstance(choices, type) else [str(c) for c in choices]
    hint = (choices.__doc__ if isinstance(choices, type) else "") if hint is None else hint
    close = difflib.get_close_matches(str(value), names, n=1, cutoff=0.6)
    shown = ", ".join((["null"] if optional else []) + names)
    return (f"{key}={value!r} is not one of [{shown}]" + (f" (did you mean {key}={close[0]}?)" if close else "")
            + (f"; {hint.strip()}" if hint and hint.strip() else "") + ".")

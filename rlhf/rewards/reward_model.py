"""Model-based rewards: the :class:`RewardModelScorer` interface and two implementations.

* :class:`HFRewardModelScorer`: a Hugging Face sequence-classification model
  (``AutoModelForSequenceClassification``, e.g. a Llama/Qwen2 reward model); the score of a
  (prompt, response) pair is the first logit at the pair's last token.
* :class:`RayRewardModelScorer`: the same scorer inside its own Ray actor (a separate worker
  process, optionally with GPUs of its own); ``score`` blocks on the actor, with an optional
  timeout.

The trainer combines these with rule and custom rewards in :mod:`rlhf.rewards.manager` (RewardManager).
"""

from __future__ import annotations

import abc
import math
from typing import Any, List, Sequence, Union

from rlhf import faults

__all__ = ["RewardModelScorer", "HFRewardModelScorer", "RayRewardModelScorer", "check_scores"]

# A prompt is either plain text or a chat-message list [{"role": ..., "content": ...}, ...].
Prompt = Union[str, List[dict]]


class RewardModelScorer(abc.ABC):
    """Scores (prompt, response) pairs with a model.

    Subclasses implement :meth:`score`. Any object with a compatible ``score`` method is
    also accepted by ``isinstance(obj, RewardModelScorer)`` (structural check), so callers
    can type-check duck-typed scorers.
    """

    @abc.abstractmethod
    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> List[float]:
        """Return one float per pair.

        Args:
            prompts: (B,) prompts, as text or chat-message lists.
            responses: (B,) decoded responses.

        Returns:
            (B,) list of finite floats; higher is better.

        Raises:
            ValueError: ``len(prompts) != len(responses)``.
        """

    def __call__(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> List[float]:
        """Alias of :meth:`score` that validates lengths and the returned values."""
        if len(prompts) != len(responses):
            raise ValueError(
                f"{type(self).__name__}: got {len(prompts)} prompts but {len(responses)} responses; they must pair up."
            )
        return check_scores(self.score(prompts, responses), len(prompts), owner=type(self).__name__)

    @classmethod
    def __subclasshook__(cls, C: type) -> Any:
        if cls is RewardModelScorer:
            if any(callable(getattr(B, "__dict__", {}).get("score")) for B in C.__mro__):
                return True
        return NotImplemented


def check_scores(scores: Sequence[Any], expected_len: int, owner: str = "scorer") -> List[float]:
    """Validate a scorer's output: length ``expected_len``, all finite numbers.

    Returns:
        The scores as a list of Python floats.

    Raises:
        ValueError: wrong length or a non-finite value (message gives the index).
        TypeError: a value is not a number.
    """
    if len(scores) != expected_len:
        raise ValueError(f"{owner} returned {len(scores)} scores for {expected_len} samples.")
    out: List[float] = []
    for i, s in enumerate(scores):
        if hasattr(s, "item") and callable(s.item):
            s = s.item()
        if not isinstance(s, (int, float)):
            raise TypeError(f"{owner} returned {type(s).__name__} {s!r} at index {i}; expected a float.")
        f = float(s)
        if not math.isfinite(f):
            raise ValueError(f"{owner} returned non-finite score {f} at index {i}.")
        out.append(f)
    return out


# --------------------------------------------------------------------------- implementations


def _as_messages(prompt: Prompt) -> List[dict]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


class HFRewardModelScorer(RewardModelScorer):
    """A Hugging Face sequence-classification reward model, run in this process.

    Each pair is rendered with the reward model's own chat template (prompt messages plus an
    ``assistant`` turn holding the response) when its tokenizer has one, else as
    ``prompt + response`` (chat prompts joined by newlines); truncated from the left to
    ``max_length`` tokens.  The score is ``logits[0]`` of the classification head at the last
    token of the pair (padding never counts, whatever the pad id).

    Args:
        path: HF model directory or hub name (config, weights and tokenizer).
        micro_batch_size: pairs per forward pass.
        max_length: token limit per pair.
        device: torch device (default ``cpu``; :class:`RayRewardModelScorer` passes ``cuda`` to a worker Ray gave
            GPUs).
        dtype: ``"float32"`` / ``"bfloat16"`` / ``"float16"``, or None for the checkpoint's.
    """

    def __init__(self, path: str, micro_batch_size: int = 16, max_length: int = 2048, device: Any = "cpu",
                 dtype: Any = None):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.path = path
        self.micro_batch_size = max(1, int(micro_batch_size))
        self.max_length = int(max_length)
        self.device = torch.device(device)
        kwargs = {"dtype": getattr(torch, dtype)} if isinstance(dtype, str) else {}
        self.model = AutoModelForSequenceClassification.from_pretrained(path, **kwargs).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.truncation_side = "left"
        self.tokenizer.padding_side = "right"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token

    def ready(self) -> bool:
        """True (the model is loaded once the object exists); :class:`RayRewardModelScorer` waits on it."""
        return True

    def render(self, prompt: Prompt, response: str) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            messages = _as_messages(prompt) + [{"role": "assistant", "content": response}]
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
        return text + response

    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> List[float]:
        import torch

        faults.maybe_stall("reward_model_slow")  # fault injection (rlhf.faults): a reward model that answers late
        texts = [self.render(p, r) for p, r in zip(prompts, responses)]
        out: List[float] = []
        with torch.no_grad():
            for i in range(0, len(texts), self.micro_batch_size):
                enc = self.tokenizer(texts[i:i + self.micro_batch_size], return_tensors="pt", padding=True,
                                     truncation=True, max_length=self.max_length,
                                     add_special_tokens=not getattr(self.tokenizer, "chat_template", None))
                enc = {k: v.to(self.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
                out += self._last_token_logit(enc).float().cpu().tolist()
        return out

    def _last_token_logit(self, enc: dict):
        import torch

        mask = enc["attention_mask"]
        last = mask.sum(1) - 1  # right padding: the last real token
        head = getattr(self.model, "score", None)
        backbone = getattr(self.model, getattr(self.model, "base_model_prefix", ""), None)
        if head is None or backbone is None:  # other heads: the model's own pooling
            return self.model(**enc).logits[:, 0]
        position_ids = (mask.cumsum(1) - 1).clamp(min=0)
        hidden = backbone(**enc, position_ids=position_ids).last_hidden_state
        return head(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])[:, 0]


class RayRewardModelScorer(RewardModelScorer):
    """:class:`HFRewardModelScorer` in a Ray actor of its own (``num_gpus`` GPUs, 0 = CPU).

    The model runs on ``cuda`` (the GPUs Ray gives the actor) when ``num_gpus > 0``, else on the CPU: an actor
    without Ray GPUs still sees every GPU of its node (Ray leaves ``CUDA_VISIBLE_DEVICES`` alone then,
    ``ray._private.utils.set_visible_accelerator_ids``), so "cuda" would be GPU 0, a trainer rank's.  The trainer's
    config refuses ``num_gpus > 0`` (rlhf.config.schema.run): trainer ranks and engines claim no Ray GPUs, so
    Ray would hand the worker one of theirs.

    Needs a running Ray session (the trainer's; else one is started locally).  The model loads in the
    worker in the background; :meth:`wait_ready` blocks until it has (the reward manager calls it before the
    first batch).  ``score`` waits for the actor at most ``timeout_s`` seconds (None: no limit) and raises
    ``ray.exceptions.GetTimeoutError`` beyond it; exceptions in the actor re-raise here.
    """

    def __init__(self, path: str, num_gpus: float = 0.0, timeout_s: float | None = None, **scorer_kwargs: Any):
        import os

        import ray

        from rlhf.rollout.ray_cluster import init_ray

        init_ray()
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {"PYTHONPATH": os.pathsep.join(p for p in [repo, os.environ.get("PYTHONPATH", "")] if p)}
        self.timeout_s, self.path = timeout_s, path
        scorer_kwargs.setdefault("device", "cuda" if num_gpus > 0 else "cpu")
        self.actor = ray.remote(HFRewardModelScorer).options(
            num_cpus=0, num_gpus=num_gpus, runtime_env={"env_vars": env}).remote(path, **scorer_kwargs)

    def wait_ready(self, timeout_s: float | None, key: str = "reward.sources[i].start_timeout_s") -> float:
        """Block until the worker has loaded the model; returns the seconds waited.

        Raises:
            TimeoutError: not loaded after `timeout_s` seconds (None: no limit); the message names `key`,
                the config key that raises the limit.
            RuntimeError: the worker died while loading (e.g. a bad path); the message carries its error.
        """
        import time

        import ray

        t0 = time.monotonic()
        try:
            ray.get(self.actor.ready.remote(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"the reward model {self.path!r} was not loaded in its Ray worker after {timeout_s:g} s "
                               f"({key}={timeout_s:g}); raise {key}, or give the worker GPUs "
                               f"(num_gpus) / a smaller model") from None
        except ray.exceptions.RayError as e:
            raise RuntimeError(f"the reward model {self.path!r} failed to load in its Ray worker: {e}") from None
        return time.monotonic() - t0

    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> List[float]:
        import ray

        return ray.get(self.actor.score.remote(list(prompts), list(responses)), timeout=self.timeout_s)

    def close(self) -> None:
        import ray

        ray.kill(self.actor)

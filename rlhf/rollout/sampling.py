"""Sampling configuration for rollouts, collection of stop token ids, and the check that training
rollouts sample from the full softmax (:func:`check_sampling`)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence

__all__ = ["SamplingConfig", "check_sampling", "stop_token_ids_for"]


@dataclass
class SamplingConfig:
    """How to sample responses.

    Attributes:
        n: samples per prompt (>= 1); requests are expanded so each sample is its own request.
        temperature: softmax temperature (>= 0); 0 means greedy. Returned log-probs are
            ``log_softmax(logits / temperature)`` of the chosen token (raw ``log_softmax`` when greedy),
            over the full vocabulary, i.e. not renormalised by top-k / top-p.
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; -1 = whole vocabulary; 0 is invalid.
        max_new_tokens: maximum response length in tokens (>= 1).
        stop_token_ids: generation stops after emitting any of these ids (the id is kept as the last
            response token). Fill with :func:`stop_token_ids_for` to include the model's EOS ids.
        seed: base seed. Sample ``j`` of prompt ``i`` gets ``sampling_seed = seed + i * n + j``. SGLang
            honours per-request seeds only when the engine runs with ``enable_deterministic_inference``;
            otherwise sampling is governed by the engine's ``random_seed``. None = no per-request seed.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: List[int] = field(default_factory=list)
    seed: Optional[int] = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingConfig.n must be an int >= 1, got {self.n!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"SamplingConfig.temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"SamplingConfig.top_k must be -1 (all) or an int >= 1, got {self.top_k!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        bad = [t for t in self.stop_token_ids if not isinstance(t, int) or isinstance(t, bool) or t < 0]
        if bad:
            raise ValueError(f"SamplingConfig.stop_token_ids must be non-negative ints, got bad entries {bad!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"SamplingConfig.seed must be an int or None, got {self.seed!r}")

    def to_sglang(self, sample_seed: Optional[int] = None) -> Dict[str, Any]:
        """SGLang ``sampling_params`` dict for ONE request (n is handled by request expansion)."""
        params: Dict[str, Any] = dict(
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            top_k=int(self.top_k),
            max_new_tokens=int(self.max_new_tokens),
            # skip_special_tokens only affects the decoded text, which rollouts do not use
        )
        if self.stop_token_ids:
            params["stop_token_ids"] = sorted(set(int(t) for t in self.stop_token_ids))
        if sample_seed is not None:
            params["sampling_seed"] = int(sample_seed)
        return params

    def with_stop_ids_from(self, tokenizer_or_path: Any, extra: Iterable[int] = ()) -> "SamplingConfig":
        """A copy whose ``stop_token_ids`` also hold every stop id of the model (see :func:`stop_token_ids_for`)."""
        ids = stop_token_ids_for(tokenizer_or_path, extra=list(self.stop_token_ids) + list(extra))
        return SamplingConfig(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=self.max_new_tokens, stop_token_ids=ids, seed=self.seed)


def _as_id_list(value: Any) -> List[int]:
    if value is None:
        return []
    if isinstance(value, bool):
        raise ValueError(f"a token id must be an int, got {value!r}")
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple, set)):
        out: List[int] = []
        for v in value:
            out.extend(_as_id_list(v))
        return out
    raise ValueError(f"a token id must be an int or a list of ints, got {value!r}")


def stop_token_ids_for(tokenizer_or_path: Any, extra: Sequence[int] = ()) -> List[int]:
    """Every id that should end a response, sorted and de-duplicated.

    Collects: the tokenizer's ``eos_token_id``; ``eos_token_id`` of the model's ``generation_config.json``
    (an int or a list); ``eos_token_id`` of ``config.json`` (int or list); and ``extra``.

    Args:
        tokenizer_or_path: a model / tokenizer directory (str or PathLike), or a tokenizer object (then
            ``name_or_path`` is used to find generation_config.json / config.json when it is a directory).
        extra: additional configured stop ids.
    Raises:
        ValueError: when a found value is not an int / list of ints, or ``extra`` holds a negative id.
    """
    ids: List[int] = []
    tokenizer = None
    directory: Optional[str] = None
    if isinstance(tokenizer_or_path, (str, os.PathLike)):
        directory = os.fspath(tokenizer_or_path)
        if not os.path.isdir(directory):
            raise ValueError(f"stop_token_ids_for: {directory!r} is not a directory")
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(directory)
        except Exception:  # a model dir without a tokenizer still has generation_config.json
            tokenizer = None
    else:
        tokenizer = tokenizer_or_path
        name = getattr(tokenizer, "name_or_path", None)
        if isinstance(name, str) and os.path.isdir(name):
            directory = name
    if tokenizer is not None:
        ids += _as_id_list(getattr(tokenizer, "eos_token_id", None))
    if directory is not None:
        for fname in ("generation_config.json", "config.json"):
            p = os.path.join(directory, fname)
            if os.path.isfile(p):
                with open(p) as f:
                    ids += _as_id_list(json.load(f).get("eos_token_id"))
    extra_ids = _as_id_list(list(extra))
    if any(i < 0 for i in extra_ids):
        raise ValueError(f"stop_token_ids_for: extra ids must be >= 0, got {list(extra)!r}")
    ids += extra_ids
    return sorted(set(i for i in ids if i >= 0))


def check_sampling(cfg) -> None:
    """Refuse training rollouts with ``rollout.top_p < 1`` or ``rollout.top_k > 0``.

    SGLang then samples from the top-p / top-k truncated, renormalised distribution q, but reports (and
    the trainer computes) log-probs of the full tempered softmax p.  PPO's importance ratio would use
    p_old where the samples came from q (log q = log p - log Z, Z the kept mass: ~0.36 nats/token at
    top_p=0.7) and ``actor/rollout_log_prob_diff`` could not see it.  With the check, the distribution
    the engine samples from is exactly the one both sides compute, which the diff metric compares.
    ``rollout.val_kwargs`` may truncate (validation trains nothing).

    Raises ValueError naming the setting and the fix.
    """
    r = cfg.rollout
    bad = ([f"rollout.top_p={r.top_p}"] if r.top_p < 1 else []) + ([f"rollout.top_k={r.top_k}"] if r.top_k > 0 else [])
    if bad:
        raise ValueError(
            f"{' and '.join(bad)}: SGLang would sample training responses from the top-p/top-k truncated, "
            "renormalised distribution while the engine's and the trainer's log-probs (PPO's importance ratio, "
            "actor/rollout_log_prob_diff) are those of the full softmax, so every update would use the wrong "
            "behaviour policy. Set rollout.top_p=1.0 rollout.top_k=-1 (rollout.temperature still applies; "
            "rollout.val_kwargs.top_p/top_k may stay for validation).")

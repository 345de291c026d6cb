"""Code data sources (``codecontests``, ``apps``, ``codeforces``, ``taco``, ...): refused unless a sandbox is set.

With ``reward.sandbox_fusion.url`` (verl's ``reward_model.sandbox_fusion.url``) set, verl's four code data sources
are scored by :mod:`rlhf.rewards.sandbox_code` in that SandboxFusion service, or with ``url: local`` in a local
sandbox (:mod:`rlhf.sandbox`) the trainer starts; the reward manager puts them before this refusal.

verl's ``default_compute_score`` scores these by running the generated program on the test cases, in a
SandboxFusion service when ``sandbox_fusion_url`` is set and otherwise in local subprocesses
(``prime_code``).  Running model-written code outside a sandbox can do anything the trainer's user can do,
so this framework does not do it: :func:`rlhf.rewards.get_reward_fn` raises
:class:`rlhf.rewards.registry.UnsupportedDataSourceError` for these names, with :data:`REASON`.  Train on them
with a custom reward (``reward.custom_reward_function`` or ``reward.sources: [{type: custom, ...}]``) that
calls your own sandbox, or register one under the data source's name (``@register_reward_fn("apps")``),
which takes precedence over the refusal.
"""
from __future__ import annotations

from .registry import refuse_data_source

__all__ = ["CODE_DATA_SOURCES", "REASON"]

#: verl's code data sources (default_compute_score), then other common code benchmarks
CODE_DATA_SOURCES = ("codecontests", "apps", "codeforces", "taco", "leetcode", "livecodebench", "humaneval", "mbpp")

REASON = ("code execution needs a sandbox and is not supported without one: scoring this data source means running "
          "the model's programs on the test cases, which this framework does not do outside a sandbox. Set "
          "reward.sandbox_fusion.url=local (a local sandbox, rlhf/sandbox/; codecontests, apps, codeforces, taco) "
          "or the URL of a SandboxFusion /run_code, or use a custom "
          "reward (reward.custom_reward_function, or reward.sources with type: custom) that calls your own "
          "sandbox (e.g. a SandboxFusion service), or register one with "
          "@rlhf.rewards.register_reward_fn(<data_source>).")

refuse_data_source(*CODE_DATA_SOURCES, reason=REASON)

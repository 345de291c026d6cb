"""The reference policy of a LoRA actor: the actor's own model with its adapters off (parallel.lora), so the
base weights are held once."""
from __future__ import annotations

import logging
from contextlib import contextmanager

from parallel.lora import LoRASettings, adapters_disabled, resolve_targets

from .dynamic_batch import PaddingCounter

__all__ = ["AdapterOffReference", "lora_settings", "adapter_sync_settings"]

logger = logging.getLogger(__name__)
_logged_fallback = False


def lora_settings(cfg) -> LoRASettings | None:
    """parallel.lora.LoRASettings from the config's ``model.lora`` section, or None when its rank is 0 (off).
    Raises ValueError for bad target_modules (parallel.lora.resolve_targets)."""
    lora = cfg.model.lora
    if not lora.rank:
        return None
    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    return LoRASettings(rank=int(lora.rank), alpha=float(lora.alpha), targets=resolve_targets(targets),
                        a_init=lora.a_init, seed=int(cfg.data.seed))


def _model_is_moe(model_path: str) -> bool:
    """Whether `model_path`'s config.json describes MoE layers (False without a readable config.json)."""
    from rlhf.preflight import hf_config_at_hand, model_is_moe

    hf = hf_config_at_hand(model_path)
    return hf is not None and model_is_moe(hf)


def adapter_sync_settings(cfg, model_path: str) -> tuple[LoRASettings | None, bool]:
    """How the engines get a LoRA actor's weights: ``(settings, merged_fallback)``.  settings: the LoRA settings
    when each sync sends the adapters through SGLang's LoRA (``model.lora.merge`` false), else None (no LoRA, or
    merged weights ``W + alpha/r B A`` each sync).  merged_fallback: True when merge=false was asked but the
    actor adapts MoE experts (target_modules with gate_proj/up_proj/down_proj or all-linear on the MoE model at
    `model_path`): SGLang 0.5.23 applies expert adapters only in its Triton/CUDA MoE-LoRA kernels
    (sglang/srt/lora/lora_moe_runners.py imports sglang.kernels.ops.lora.moe.fused_moe_lora_kernel, a triton.jit
    kernel; docs/lora.md), so every sync sends the merged weights instead (logged once; the sync's metrics carry
    ``weight_sync/lora_merged_fallback``)."""
    global _logged_fallback
    settings = lora_settings(cfg)
    if settings is None or cfg.model.lora.merge:
        return None, False
    if {"linear_fc1", "linear_fc2"} & set(settings.targets) and _model_is_moe(model_path):
        if not _logged_fallback:
            _logged_fallback = True
            logger.warning("model.lora.merge=false with LoRA on MoE experts (target_modules %s): SGLang 0.5.23 runs "
                           "MoE LoRA only in CUDA Triton kernels, so each weight sync sends the merged weights "
                           "W + alpha/r B A instead of the adapters (metric weight_sync/lora_merged_fallback; "
                           "docs/lora.md)", list(cfg.model.lora.target_modules)
                           if not isinstance(cfg.model.lora.target_modules, str) else cfg.model.lora.target_modules)
        return None, True
    return settings, False


class AdapterOffReference:
    """What the trainers use of a reference (``compute_log_prob``, ``padding``, ``bundle``): the LoRA `actor`
    (rlhf.workers.actor.MegatronActor) computing with its adapters off and its chunks in eval mode, as a
    separate reference model would.  Collective like the actor's methods; the passes are counted in the
    actor's padding counter (this one stays empty)."""

    def __init__(self, actor):
        self.actor = actor
        self.padding = PaddingCounter()

    @property
    def bundle(self):
        return self.actor.bundle

    @property
    def chunks(self) -> list:
        return self.actor.chunks

    @contextmanager
    def _as_base(self):
        chunks = self.actor.chunks
        modes = [c.training for c in chunks]
        for c in chunks:
            c.eval()
        try:
            with adapters_disabled(chunks):
                yield
        finally:
            for c, m in zip(chunks, modes):
                c.train(m)

    def compute_log_prob(self, batch: dict, *, calculate_entropy: bool = False) -> dict:
        """The base model's per-token log-probs of the response tokens (MegatronActor.compute_log_prob)."""
        with self._as_base():
            return self.actor.compute_log_prob(batch, calculate_entropy=calculate_entropy)

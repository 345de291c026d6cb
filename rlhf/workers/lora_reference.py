"""The reference policy of a LoRA actor: the actor's own model with its adapters off (parallel.lora), so the
base weights are held once."""
from __future__ import annotations

from contextlib import contextmanager

from parallel.lora import LoRASettings, adapters_disabled, resolve_targets

from .dynamic_batch import PaddingCounter

__all__ = ["AdapterOffReference", "lora_settings"]


def lora_settings(cfg) -> LoRASettings | None:
    """parallel.lora.LoRASettings from the config's ``model.lora`` section, or None when its rank is 0 (off).
    Raises ValueError for bad target_modules (parallel.lora.resolve_targets)."""
    lora = cfg.model.lora
    if not lora.rank:
        return None
    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    return LoRASettings(rank=int(lora.rank), alpha=float(lora.alpha), targets=resolve_targets(targets),
                        a_init=lora.a_init, seed=int(cfg.data.seed))


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

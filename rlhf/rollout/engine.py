"""The engine fleet's interface: what the trainer and the weight bridge may ask of the rollout engines.

One typed seam (as OpenRLHF's vllm_engine.py and slime's sglang_engine.py call engines as methods): every
call is a method with SGLang's own name and arguments, implemented by
:class:`rlhf.rollout.manager.RolloutManager` over Ray actors (:class:`rlhf.rollout.sglang_engine.SGLangEngine`)
and by the test doubles in tests/support/fakes.py.  Nothing calls an engine by a method-name string
(tests/unit/test_layout_rules.py refuses it).

Fan-out rules shared by every method:
* ``engines``: the engine indices to call (default: all, in order); results come back in that order.
* ``per_engine``-style arguments (one entry per target engine) carry what differs between engines (each
  engine's serialized payloads, each engine's rank offset in a weight-update group).
* The weight-loading calls (``update_weights_from_tensor``, ``update_weights_from_distributed``,
  ``init_weights_update_group``) start the engines' work and return a :data:`Pending`; :meth:`wait` collects
  it.  The bridge writes bucket k+1 while the engines load bucket k, and the distributed transport must join
  the group it asked the engines to join before it waits.
* An engine whose actor died during a call is replaced (and is stale until a sync reaches it); its result
  is None.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

from rlhf.rollout.sampling import SamplingConfig
from rlhf.rollout.types import RolloutSample

__all__ = ["EngineFleet", "Pending"]

#: ``[(engine index, in-flight result)]`` of a started call; :meth:`EngineFleet.wait` resolves it.
Pending = List[Tuple[int, Any]]


@runtime_checkable
class EngineFleet(Protocol):
    """The rollout engines as one handle.  Attributes: ``num_engines``, ``tp_size`` (ranks per engine)."""

    num_engines: int
    tp_size: int

    # ---- generation
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig) -> List[RolloutSample]:
        """``sampling.n`` samples per prompt, prompt-major, over the engines that serve the latest weights."""

    # ---- weights: what a sync is planned against, and its bookkeeping
    def expected_weights(self) -> Dict[str, Any]:
        """``{hf_name: (shape, dtype)}`` every engine accepts."""

    def fingerprint(self) -> tuple:
        """Changes whenever what a sync was planned and validated against changes (restarts, model, TP)."""

    def stale_engines(self) -> List[int]:
        """Engines restarted since the last sync that reached them."""

    def begin_sync(self) -> tuple:
        """Mark the start of a sync; the token goes to :meth:`replaced_since` and :meth:`end_sync`.  Raises
        RuntimeError while the fleet generates (a sync writes into the engines' parameters between rollouts)."""

    def replaced_since(self, token: tuple) -> List[int]:
        """Engines replaced after :meth:`begin_sync` returned ``token``."""

    def end_sync(self, token: tuple, engines: Optional[Sequence[int]] = None) -> None:
        """The sync begun with ``token`` reached ``engines`` (default all)."""

    # ---- weights: SGLang's calls
    def begin_weight_update(self, engines: Optional[Sequence[int]] = None) -> None:
        """Open a weight-update session on each engine (SGLang >= 0.5.23 needs one around updates)."""

    def start_weight_update(self, engines: Optional[Sequence[int]] = None) -> Pending:
        """Start :meth:`begin_weight_update` on each engine without waiting (:meth:`wait` collects it): the weight
        sync opens the sessions while its ranks agree on the plan."""

    def end_weight_update(self, engines: Optional[Sequence[int]] = None) -> List[Any]:
        """Close the sessions; returns each engine's weight version."""

    def update_weights_from_tensor(self, payloads: Sequence[Sequence[bytes]], engines: Optional[Sequence[int]] = None,
                                   load_format: str = "flattened_bucket", flush_cache: bool = False) -> Pending:
        """Start loading one bucket: ``payloads[k]`` is target engine k's list of serialized
        FlattenedTensorBuckets, one per engine TP rank (bytes only, never tensors)."""

    def init_weights_update_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                                  backend: str, rank_offsets: Sequence[int]) -> Pending:
        """Start every engine joining weight-update group ``group_name``; engine k's ranks start at
        ``rank_offsets[k]`` (the call blocks in the engines until the sender joins too)."""

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                        shapes: Sequence[Sequence[int]], group_name: str, flush_cache: bool = False,
                                        load_format: Optional[str] = "flattened_bucket") -> Pending:
        """Start every engine receiving one broadcast bucket on ``group_name``."""

    def load_lora_adapter(self, tensors: Dict[str, Any], config: Dict[str, Any],
                          engines: Optional[Sequence[int]] = None) -> Pending:
        """Start loading a LoRA adapter (``{PEFT name: CPU tensor}`` and its PEFT ``adapter_config`` dict) on each
        engine, in place of the adapter it holds; the engines' generations use it from then on."""

    def engine_parameters(self, engines: Optional[Sequence[int]] = None) -> List[Any]:
        """Each engine's ``[per TP rank {parameter name: CPU tensor}]`` (the whole model: tests, diagnostics)."""

    def destroy_weights_update_group(self, group_name: str) -> List[Any]:
        """Every engine leaves ``group_name``."""

    def update_weights_from_disk(self, model_path: str, engines: Optional[Sequence[int]] = None) -> List[Any]:
        """Reload every weight from an HF checkpoint directory; returns each engine's weight version."""

    def get_weights_by_name(self, name: str, truncate_size: int = 100,
                            engines: Optional[Sequence[int]] = None) -> List[Any]:
        """Each engine's TP-rank-0 copy of ``name`` (first ``truncate_size`` rows, as lists)."""

    def flush_cache(self, engines: Optional[Sequence[int]] = None) -> None:
        """Drop the engines' prefix caches."""

    def wait(self, pending: Pending, what: str = "call") -> List[Any]:
        """Results of a started call, in order (None for an engine that died and was replaced)."""

    # ---- memory (colocated)
    def release_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None:
        """Colocated: free the engines' ``tags`` (default weights and KV cache) while the trainer runs."""

    def resume_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None:
        """Colocated: re-allocate ``tags`` (default all) that the engines released.  Resumed ``weights`` are memory
        without the weights (SGLang's memory saver keeps no copy): a sync must reach the engines before they
        generate."""

    # ---- lifetime
    def info(self, engines: Optional[Sequence[int]] = None) -> List[Dict[str, Any]]:
        """Each engine's ``{pid, weight_version, ...}``."""

    def shutdown(self) -> None:
        """Stop every engine."""

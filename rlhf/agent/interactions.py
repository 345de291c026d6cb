"""Interactions with verl's interface (verl/interactions/base.py): a simulated user that answers each model turn
(``generate_response`` -> (stop?, user text, turn score, metrics)).  :class:`Gsm8kInteraction` is verl's."""
from __future__ import annotations

import uuid
from typing import Any, Optional

from rlhf.agent.config import InteractionSpec, resolve_class

__all__ = ["BaseInteraction", "Gsm8kInteraction", "build_interactions"]


class BaseInteraction:
    def __init__(self, config: dict):
        self.config = dict(config or {})
        self.name = self.config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: Optional[str] = None, **kwargs) -> str:
        return instance_id or uuid.uuid4().hex

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs) -> tuple[bool, str, float, dict]:
        return True, "Your current result seems acceptable.", 0.8, {}

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        pass


class Gsm8kInteraction(BaseInteraction):
    """verl's Gsm8kInteraction: scores the last assistant message strictly against ``ground_truth``
    (``extra_info.interaction_kwargs``); correct ends the conversation, else the user asks to try again."""

    def __init__(self, config: dict):
        super().__init__(config)
        self._instances: dict[str, dict] = {}

    async def start_interaction(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None,
                                **kwargs) -> str:
        instance_id = instance_id or uuid.uuid4().hex
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs) -> tuple[bool, str, float, dict]:
        content = next((m.get("content") for m in reversed(messages) if m.get("role") == "assistant"), "")
        self._instances[instance_id]["response"] = content
        reward = await self.calculate_score(instance_id)
        if reward == 1.0:
            return True, "Your response is correct!", reward, {}
        return False, "Your response is incorrect! You need to reflect on your answer and try again.", reward, {}

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        from rlhf.rewards.gsm8k import compute_score

        state = self._instances[instance_id]
        if state["ground_truth"] is None:
            return 0.0
        return compute_score(state["response"], state["ground_truth"], method="strict", format_score=0.0, score=1.0)

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)


def build_interactions(specs: list[InteractionSpec]) -> dict[str, BaseInteraction]:
    """``{name: interaction}`` of the config file (verl's class names mapped: rlhf.agent.config)."""
    out = {}
    for s in specs:
        out[s.name] = resolve_class(s.class_name, "interaction")({**s.config, "name": s.name})
    return out

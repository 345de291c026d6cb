"""Tools with verl's interface (verl/tools/base_tool.py): ``create`` an instance per trajectory, ``execute`` a call
(-> text response, step reward, metrics), ``calc_reward``, ``release``; all coroutines.  :class:`Gsm8kTool` is
verl's (verl/tools/gsm8k_tool.py), scored by rlhf.rewards.gsm8k."""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Optional

from rlhf.agent.config import ToolSpec, resolve_class

__all__ = ["ToolResponse", "BaseTool", "Gsm8kTool", "build_tools"]


@dataclass
class ToolResponse:
    """What a tool returns to the conversation (verl's ToolResponse, text only here)."""

    text: Optional[str] = None


class BaseTool:
    """verl's BaseTool: ``config`` (the config file's ``config:``), ``tool_schema`` (the OpenAI function schema,
    a dict); :attr:`name` is the function name the model calls."""

    def __init__(self, config: dict, tool_schema: dict):
        self.config, self.tool_schema = dict(config or {}), tool_schema
        self.name = tool_schema["function"]["name"]

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        return instance_id or uuid.uuid4().hex, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        pass


class Gsm8kTool(BaseTool):
    """verl's Gsm8kTool: the model submits ``answer``; the response states the parsed answer and its reward (1.0
    when it equals the trajectory's ``ground_truth``, from ``tools_kwargs.<name>.create_kwargs``); the step reward
    is 0.0 when the reward improved, else -0.05 (verl's penalty for resubmitting a no-better answer)."""

    def __init__(self, config: dict, tool_schema: dict):
        super().__init__(config, tool_schema)
        self._instances: dict[str, dict] = {}

    async def create(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None,
                     **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or uuid.uuid4().hex
        if ground_truth is None:
            ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth")
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        answer = parameters.get("answer", "")
        answer = answer if isinstance(answer, str) else str(answer)
        state = self._instances[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        tool_reward = 0.0 if reward > state["reward"] else -0.05
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), tool_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        from rlhf.rewards.gsm8k import compute_score

        state = self._instances[instance_id]
        if state["ground_truth"] is None:
            return 0.0
        return compute_score(state["response"], state["ground_truth"], method="flexible", format_score=0.0,
                             score=1.0)

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)


def build_tools(specs: list[ToolSpec]) -> dict[str, BaseTool]:
    """``{function name: tool}`` of the config file's tools (verl's class names mapped: rlhf.agent.config)."""
    out: dict[str, BaseTool] = {}
    for s in specs:
        if s.mcp is not None:  # verl's MCP entry: the tools its servers offer
            from rlhf.agent.mcp_tool import mcp_tools

            new = mcp_tools(s.mcp)
        else:
            new = {s.name: resolve_class(s.class_name, "tool")(s.config, s.tool_schema)}
        clash = sorted(set(new) & set(out))
        if clash:
            raise ValueError(f"tool names repeat: {clash}")
        out.update(new)
    return out

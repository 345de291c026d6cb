"""verl's multi-turn settings and config files, read and checked before anything is built.

* ``rollout.multi_turn`` (verl: ``actor_rollout_ref.rollout.multi_turn``): :class:`MultiTurnSettings`.
* the tool config (``tool_config_path``), verl's YAML::

      tools:
        - class_name: verl.tools.gsm8k_tool.Gsm8kTool     # verl's class name, mapped to ours (TOOL_CLASSES)
          config: {type: native}
          tool_schema: {type: function, function: {name: calc_gsm8k_reward, description: ..., parameters: {...}}}

* the interaction config (``interaction_config_path``)::

      interaction:
        - name: gsm8k
          class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction
          config: {}

A class name that is not one of verl's mapped here is imported as ``module.Class`` (a user's own class with verl's
interface); verl's classes not ported (Geo3kTool, ...) are refused by name.  MCP entries (``config.type: mcp``,
verl's MCPBaseTool / MCPSearchTool) take their tools from local MCP servers (rlhf.agent.mcp_tool).  A tool class may check its ``config:``
at ``--cfg`` with a classmethod ``config_problems(config) -> [message]``.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

__all__ = ["MultiTurnSettings", "ToolSpec", "InteractionSpec", "load_tool_specs", "load_interaction_specs",
           "resolve_class", "config_problems", "resolve_config_file", "TRUNCATE_SIDES", "VERL_FORMATS"]

TRUNCATE_SIDES = ("left", "middle", "right")
#: verl's ``multi_turn.format`` names -> SGLang's FunctionCallParser names (others are passed through)
VERL_FORMATS = {"hermes": "hermes", "gpt-oss": "gpt-oss", "llama3_json": "llama3", "qwen25": "qwen25"}

#: verl's class names -> ours (module path, class); verl's classes absent here are refused with this note
_TOOLS = {"verl.tools.gsm8k_tool.Gsm8kTool": "rlhf.agent.tools.Gsm8kTool",
          "verl.tools.sandbox_fusion_tools.SandboxFusionTool": "rlhf.agent.sandbox_tool.SandboxFusionTool",
          "verl.tools.search_tool.SearchTool": "rlhf.agent.search.SearchTool",
          "verl.tools.mcp_base_tool.MCPBaseTool": "rlhf.agent.mcp_tool.MCPTool",
          "verl.tools.mcp_search_tool.MCPSearchTool": "rlhf.agent.mcp_tool.MCPTool"}
_INTERACTIONS = {"verl.interactions.gsm8k_interaction.Gsm8kInteraction": "rlhf.agent.interactions.Gsm8kInteraction"}
#: verl's other tool / interaction classes (verl/tools/*.py, verl/interactions/*.py): real names without a port, told
#: apart from a misspelt name (an unknown class, with the nearest known name)
_VERL_ONLY = {"tool": [f"verl.tools.{m}" for m in ("geo3k_tool.Geo3kTool", "image_zoom_in_tool.ImageZoomInTool")],
    "interaction": ["verl.interactions.weather_interaction.WeatherInteraction"]}


@dataclass
class MultiTurnSettings:
    """``rollout.multi_turn`` (verl's names and defaults, plus ``tool_timeout_s`` and ``max_tokens_per_turn``).

    Attributes:
        enable: run the agent loop instead of single-turn generation.
        max_assistant_turns / max_user_turns: stop after that many model turns / tool-or-user turns (None: no limit
            besides the response length).
        max_parallel_calls: tool calls executed per model turn (the rest are dropped, as verl does).
        max_tool_response_length: characters of a tool's text kept; longer text is cut on
            ``tool_response_truncate_side`` (verl's: "left" keeps the start, "right" the end, "middle" both ends).
        tool_config_path / interaction_config_path: verl's YAML files (module docstring).
        format: the tool-call format, one of SGLang's FunctionCallParser names (verl's hermes, llama3_json, ...).
        tool_timeout_s: seconds a tool call may take; then the model reads a timeout message.
        max_tokens_per_turn: tokens one model turn may generate (None: what is left of data.max_response_length).
    """

    enable: bool = False
    max_assistant_turns: Optional[int] = None
    max_user_turns: Optional[int] = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    tool_config_path: Optional[str] = None
    interaction_config_path: Optional[str] = None
    format: str = "hermes"
    tool_timeout_s: float = 30.0
    max_tokens_per_turn: Optional[int] = None

    @classmethod
    def from_config(cls, node: Any) -> "MultiTurnSettings":
        """From ``cfg.rollout.multi_turn`` (an OmegaConf node or a dict)."""
        get = node.get if hasattr(node, "get") else (lambda k, d: getattr(node, k, d))
        return cls(**{k: get(k, f.default) for k, f in cls.__dataclass_fields__.items()})

    @property
    def parser_name(self) -> str:
        """SGLang's FunctionCallParser name of :attr:`format`."""
        return VERL_FORMATS.get(self.format, self.format)


@dataclass
class ToolSpec:
    class_name: str
    config: dict
    tool_schema: Optional[dict]
    mcp: Optional[dict] = None  # an MCP entry (its whole item): its tools come from its servers

    @property
    def name(self) -> Optional[str]:
        return None if self.tool_schema is None else self.tool_schema["function"]["name"]


@dataclass
class InteractionSpec:
    name: str
    class_name: str
    config: dict


def resolve_class(class_name: str, kind: str) -> type:
    """The class of a tool / interaction ``class_name`` (verl's name or ``module.Class``).

    Raises:
        ValueError: verl's class not ported here, or a name that does not import (message names it and the fix).
    """
    import difflib

    table = _TOOLS if kind == "tool" else _INTERACTIONS
    target = table.get(class_name, class_name)
    known = [*table, *table.values(), *_VERL_ONLY[kind]]
    near = difflib.get_close_matches(class_name, known, n=1, cutoff=0.8)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    if target == class_name and class_name in _VERL_ONLY[kind]:
        raise ValueError(f"{kind} class {class_name!r} is verl's and has no port here (available: "
                         f"{', '.join(sorted(table))}, or a class of your own as module.Class with verl's interface)")
    if target == class_name and class_name.startswith("verl."):
        raise ValueError(f"unknown {kind} class {class_name!r}: not one of verl's{hint} (ported here: "
                         f"{', '.join(sorted(table))})")
    module, _, attr = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
        if near:
            raise ValueError(f"unknown {kind} class {class_name!r} ({e}){hint}") from e
        raise ValueError(f"{kind} class {class_name!r} does not import ({e}); give module.Class of an installed "
                         f"module") from e


def resolve_config_file(path: str) -> Path:
    """``path`` as given, else (relative and absent from the CWD) under the repository root, as data files are
    found (rlhf.data.files), so a recipe's ``recipes/<name>/tool_config.yaml`` works from any CWD."""
    p = Path(path).expanduser()
    if not p.is_file() and not p.is_absolute():
        q = Path(__file__).resolve().parents[2] / p
        if q.is_file():
            return q
    return p


def _load(path: str, key: str) -> list:
    p = resolve_config_file(path)
    if not p.is_file():
        raise ValueError(f"{path!r} is not a file (relative paths are read from {Path.cwd()} and the repository "
                         f"root {Path(__file__).resolve().parents[2]})")
    data = yaml.safe_load(p.read_text()) or {}
    items = data.get(key) if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise ValueError(f"{path!r} holds no '{key}:' list (verl's layout: {key}: [{{class_name: ..., ...}}])")
    return items


def load_tool_specs(path: str) -> list[ToolSpec]:
    """The tools of verl's tool config file ``path``; an MCP entry (``config.type: mcp``) is one spec whose tools
    come from its servers when built (rlhf.agent.mcp_tool).  Raises ValueError naming the file and the bad entry."""
    out = []
    for i, item in enumerate(_load(path, "tools")):
        if isinstance(item, dict) and "class_name" in item and (item.get("config") or {}).get("type") == "mcp":
            out.append(ToolSpec(str(item["class_name"]), dict(item.get("config") or {}), None, dict(item)))
            continue
        schema = item.get("tool_schema") if isinstance(item, dict) else None
        if not isinstance(schema, dict) or not isinstance(schema.get("function"), dict) or \
                not schema["function"].get("name") or "class_name" not in item:
            raise ValueError(f"{path!r}: tools[{i}] needs class_name and tool_schema.function.name (verl's layout)")
        out.append(ToolSpec(str(item["class_name"]), dict(item.get("config") or {}), schema))
    names = [s.name for s in out if s.mcp is None]
    if len(set(names)) != len(names):
        raise ValueError(f"{path!r}: tool names repeat: {names}")
    return out


def load_interaction_specs(path: str) -> list[InteractionSpec]:
    """The interactions of verl's interaction config file; a missing name is the class name without
    "Interaction", lower-cased (verl's rule).  Raises ValueError naming the file and the bad entry."""
    out = []
    for i, item in enumerate(_load(path, "interaction")):
        if not isinstance(item, dict) or "class_name" not in item:
            raise ValueError(f"{path!r}: interaction[{i}] needs class_name (verl's layout)")
        name = item.get("name") or item["class_name"].rsplit(".", 1)[-1].replace("Interaction", "").lower()
        out.append(InteractionSpec(str(name), str(item["class_name"]), dict(item.get("config") or {})))
    return out


def config_problems(mt: Any, at: str = "rollout.multi_turn.") -> list[str]:
    """Problems of ``rollout.multi_turn`` (checked at ``--cfg``): the truncate side, the format (SGLang's parser
    names), each config file and every class it names.  Nothing is checked while ``enable`` is false."""
    if not mt.enable:
        return []
    out = []
    if mt.tool_response_truncate_side not in TRUNCATE_SIDES:
        out.append(f"{at}tool_response_truncate_side={mt.tool_response_truncate_side!r} must be one of "
                   f"{list(TRUNCATE_SIDES)}.")
    for key in ("max_assistant_turns", "max_user_turns", "max_tokens_per_turn"):
        v = getattr(mt, key)
        if v is not None and v < 1:
            out.append(f"{at}{key}={v!r} must be >= 1 (or null: no limit).")
    if mt.max_parallel_calls < 1 or mt.max_tool_response_length < 1 or not mt.tool_timeout_s > 0:
        out.append(f"{at}max_parallel_calls, max_tool_response_length must be >= 1 and tool_timeout_s > 0 (got "
                   f"{mt.max_parallel_calls}, {mt.max_tool_response_length}, {mt.tool_timeout_s}).")
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    parser = VERL_FORMATS.get(mt.format, mt.format)
    if parser not in FunctionCallParser.ToolCallParserEnum:
        out.append(f"{at}format={mt.format!r} is not a tool-call format of SGLang's FunctionCallParser (one of "
                   f"{sorted(FunctionCallParser.ToolCallParserEnum)}; verl's llama3_json is llama3).")
    for key, load, kind in (("tool_config_path", load_tool_specs, "tool"),
                            ("interaction_config_path", load_interaction_specs, "interaction")):
        path = getattr(mt, key)
        if path:
            try:
                for spec in load(path):
                    cls = resolve_class(spec.class_name, kind)
                    if getattr(spec, "mcp", None) is not None:
                        from rlhf.agent.mcp_tool import mcp_config_problems

                        problems = mcp_config_problems(spec.mcp)
                    else:
                        check = getattr(cls, "config_problems", None)
                        problems = check(spec.config) if check else []
                    out += [f"{at}{key}={path!r}: {p}." for p in problems]
            except ValueError as e:
                out.append(f"{at}{key}={path!r}: {e}.")
    return out

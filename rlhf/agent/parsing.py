"""Tool calls in a model turn, parsed by SGLang's FunctionCallParser (sglang.srt.function_call; the detector by
``rollout.multi_turn.format``: hermes, qwen25, llama3, ...), with what SGLang drops kept as errors: a call whose
JSON does not parse (SGLang's detector then returns no call) and a call of a name that is no tool (SGLang skips it
unless SGLANG_FORWARD_UNKNOWN_TOOLS is set, which :meth:`ToolCallParser.parse` sets while it parses)."""
from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["ParsedCall", "ToolCallParser"]


@dataclass
class ParsedCall:
    """One tool call: ``name`` (None when the call did not parse), ``arguments`` (a dict; None when bad), ``error``
    (None, or ``"parse_error"`` / ``"unknown_tool"`` / ``"invalid_arguments"`` with ``detail``)."""

    name: Optional[str]
    arguments: Optional[dict]
    error: Optional[str] = None
    detail: str = ""


def _drop(record: logging.LogRecord) -> bool:
    return False


@contextlib.contextmanager
def _forward_unknown_tools(detector: Any):
    """SGLang's detectors forward calls of unknown tools, and their per-call log lines (an unknown function, a
    call that does not parse) are dropped: each such call is counted (tool_calls/<kind>) and the agent loop logs
    the first of each kind."""
    old = os.environ.get("SGLANG_FORWARD_UNKNOWN_TOOLS")
    os.environ["SGLANG_FORWARD_UNKNOWN_TOOLS"] = "1"
    loggers = {logging.getLogger(c.__module__) for c in type(detector).__mro__ if c.__module__.startswith("sglang.")}
    for lg in loggers:
        lg.addFilter(_drop)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(_drop)
        if old is None:
            os.environ.pop("SGLANG_FORWARD_UNKNOWN_TOOLS", None)
        else:
            os.environ["SGLANG_FORWARD_UNKNOWN_TOOLS"] = old


def _arguments(raw: Any) -> Optional[dict]:
    """The call's arguments as a dict: SGLang's JSON text, possibly of a JSON string some models emit."""
    try:
        value = json.loads(raw) if isinstance(raw, str) else raw
        if isinstance(value, str):
            value = json.loads(value)
    except (TypeError, ValueError):
        return None
    return value if isinstance(value, dict) else None


class ToolCallParser:
    """Parses model turns for the tools ``tool_schemas`` (OpenAI function schemas, dicts) in format ``parser_name``
    (a FunctionCallParser name).  Raises ValueError for an unknown format (checked at --cfg already)."""

    def __init__(self, tool_schemas: list[dict], parser_name: str):
        from sglang.srt.entrypoints.openai.protocol import Tool
        from sglang.srt.function_call.function_call_parser import FunctionCallParser

        self.names = [s["function"]["name"] for s in tool_schemas]
        self.parser = FunctionCallParser([Tool.model_validate(s) for s in tool_schemas], parser_name)

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """``(normal text, calls)`` of one decoded model turn; no call when it holds none."""
        if not self.names or not self.parser.has_tool_call(text):
            return text, []
        with _forward_unknown_tools(self.parser.detector):
            normal, items = self.parser.parse_non_stream(text)
        if not items:  # SGLang's detectors give up on the whole turn when one call's JSON does not parse
            return normal, [ParsedCall(None, None, "parse_error",
                                       f"the tool call could not be parsed as JSON in the {self.parser.detector.__class__.__name__[:-8].lower()} format")]
        calls = []
        for item in items:
            if item.name not in self.names:
                calls.append(ParsedCall(item.name, None, "unknown_tool",
                                        f"unknown tool {item.name!r} (available: {', '.join(self.names)})"))
                continue
            args = _arguments(item.parameters)
            calls.append(ParsedCall(item.name, args) if args is not None else ParsedCall(
                item.name, None, "invalid_arguments", f"the arguments of {item.name!r} are not a JSON object: "
                f"{str(item.parameters)[:200]}"))
        return normal, calls

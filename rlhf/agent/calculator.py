"""A calculator tool with verl's tool interface: safe arithmetic evaluation of one expression.

The expression is parsed with Python's ``ast`` and only these nodes are evaluated: int / float literals, the binary
operators ``+ - * / // % **``, unary ``+ -`` and parentheses.  Names, calls, attributes, subscripts, strings and
everything else are refused; nothing is ever passed to ``eval``.  Sizes are bounded so a call cannot stall the
trainer: at most :data:`MAX_EXPRESSION_CHARS` characters, exponents up to :data:`MAX_EXPONENT`, results up to
:data:`MAX_RESULT_DIGITS` digits.

Bad input (a missing or non-string ``expression``, a syntax error, a refused construct, division by zero, a result
too large) is the tool's answer ``"Error: ..."`` naming the problem, with a step reward of 0 and
``metrics["error"]`` set; the tool never raises for it.  Config file entry (verl's layout)::

    tools:
      - class_name: rlhf.agent.calculator.CalculatorTool
        config: {}
        tool_schema:
          type: function
          function:
            name: calc
            description: Evaluate an arithmetic expression (+ - * / // % ** and parentheses).
            parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}
"""
from __future__ import annotations

import ast
import operator
from typing import Any, Optional, Union

from rlhf.agent.tools import BaseTool, ToolResponse

__all__ = ["CalculatorTool", "safe_eval", "format_number", "CalcError", "MAX_EXPRESSION_CHARS", "MAX_EXPONENT",
           "MAX_RESULT_DIGITS"]

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_RESULT_DIGITS = 60

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ValueError):
    """An expression the calculator refuses; the message says why."""


def _too_big(v: Union[int, float]) -> bool:
    return abs(v) >= 10 ** MAX_RESULT_DIGITS


def _eval(node: ast.AST) -> Union[int, float]:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(b) > MAX_EXPONENT:
            raise CalcError(f"exponent {b} is larger than {MAX_EXPONENT}")
        try:
            v = _BINARY[type(node.op)](a, b)
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        except OverflowError:
            raise CalcError(f"the result has more than {MAX_RESULT_DIGITS} digits") from None
        if isinstance(v, complex):
            raise CalcError("the result is not a real number")
        if _too_big(v):
            raise CalcError(f"the result has more than {MAX_RESULT_DIGITS} digits")
        return v
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    what = type(node).__name__ if not isinstance(node, ast.Constant) else f"the literal {node.value!r}"
    raise CalcError(f"{what} is not allowed (only numbers, + - * / // % ** and parentheses)")


def safe_eval(expression: str) -> Union[int, float]:
    """The value of arithmetic ``expression`` (e.g. ``"37*48"`` -> 1776, ``"7/2"`` -> 3.5), Python's semantics for
    the allowed operators (module docstring).

    Raises:
        CalcError: not a string, too long, a syntax error, a construct other than numbers and the allowed
            operators, division by zero, an exponent above MAX_EXPONENT or a result above MAX_RESULT_DIGITS digits.
    """
    if not isinstance(expression, str):
        raise CalcError(f"the expression must be a string, got {type(expression).__name__} {expression!r}")
    text = expression.strip()
    if not text:
        raise CalcError("the expression is empty")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"the expression has {len(text)} characters (at most {MAX_EXPRESSION_CHARS})")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise CalcError(f"{text!r} is not an arithmetic expression ({e.msg})") from None
    return _eval(tree.body)


def format_number(v: Union[int, float]) -> str:
    """``v`` as the tool writes it: integers (and integral floats) without a fraction, others to 10 significant
    digits (``1776``, ``3.5``, ``0.3333333333``)."""
    if isinstance(v, float) and v.is_integer() and not _too_big(v):
        return str(int(v))
    return str(v) if isinstance(v, int) else f"{v:.10g}"


class CalculatorTool(BaseTool):
    """The calculator (module docstring).  ``execute(instance, {"expression": "37*48"})`` answers ``"1776"`` with
    step reward 0.0 and metrics ``{}``; bad input answers ``"Error: <why>"`` with metrics ``{"error": <why>}``.
    The argument's name is the first property of ``tool_schema``'s parameters (default ``expression``)."""

    def __init__(self, config: dict, tool_schema: dict):
        super().__init__(config, tool_schema)
        props = ((tool_schema.get("function") or {}).get("parameters") or {}).get("properties") or {}
        self.argument = next(iter(props), "expression")

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs) -> tuple[ToolResponse, float, dict]:
        expression: Optional[Any] = (parameters or {}).get(self.argument)
        if expression is None:
            why = f"missing argument {self.argument!r} (got {sorted(parameters or {})})"
            return ToolResponse(text=f"Error: {why}"), 0.0, {"error": why}
        try:
            value = safe_eval(expression if isinstance(expression, str) else str(expression)
                              if isinstance(expression, (int, float)) and not isinstance(expression, bool)
                              else expression)
        except CalcError as e:
            return ToolResponse(text=f"Error: {e}"), 0.0, {"error": str(e)}
        return ToolResponse(text=format_number(value)), 0.0, {}

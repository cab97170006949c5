"""The tools that ship with the project; each is a function of one string that returns a string,
and runs inside a sandbox worker (`sandbox.pool`), never in a service process.

- `calculator`: one arithmetic expression over numbers with + - * / // % ** and parentheses;
  the exact result (integers stay integers of any size; an exponent above 1000 is refused).
- `python`: runs a Python program in a fresh namespace and returns what it printed, then the
  value of its last line when that is an expression (as an interactive session shows it).
"""

from __future__ import annotations

import ast
import contextlib
import io
import operator
from collections.abc import Callable
from fractions import Fraction
from typing import Any

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
BUILTIN_TOOLS = {
    "calculator": "sandbox.builtin_tools:calculator",
    "python": "sandbox.builtin_tools:python",
}
"""The tools `rollout.tools.functions` names without a module, and where each lives."""
MAX_EXPONENT = 1000
MAX_EXPRESSION_CHARS = 256


def calculator(expression: str) -> str:
    """The value of `expression` ("12*(3+4)" -> "84", "7/2" -> "3.5")."""
    text = expression.strip()
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is over {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {text!r}") from None
    try:
        value = _evaluate(tree.body)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    if isinstance(value, Fraction):
        if value.denominator == 1:
            return str(value.numerator)
        return repr(float(value))
    return str(value)


def _evaluate(node: ast.expr) -> int | Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.Constant) and type(node.value) is float:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        inner = _evaluate(node.operand)
        return -inner if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(Fraction(right)) > MAX_EXPONENT:
            raise ValueError(f"an exponent above {MAX_EXPONENT}")
        if isinstance(node.op, ast.Div):
            return Fraction(left) / Fraction(right)  # exact: 7/2 is 3.5, 6/3 is 2
        return _BINARY[type(node.op)](left, right)  # type: ignore[no-any-return]
    raise ValueError(f"not allowed in an arithmetic expression: {ast.unparse(node)!r}")


def python(code: str) -> str:
    """What running `code` printed, then the repr of its last line if that is an expression."""
    tree = ast.parse(code, mode="exec")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    assert last is None or isinstance(last, ast.Expr)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(tree, "<tool>", "exec"), namespace)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), namespace)
            if value is not None:
                print(repr(value))  # noqa: T201  (the tool's output, as a REPL shows it)
    return out.getvalue()

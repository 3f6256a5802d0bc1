"""The calculator tool: a safe evaluator of arithmetic expressions (Python's ``ast``, never ``eval``)."""

from __future__ import annotations

import ast
import operator

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
MAX_EXPONENT = 100
"""A larger power could take the worker's whole memory."""


def _value(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _value(node.operand)
        return value if isinstance(node.op, ast.UAdd) else -value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        return OPERATORS[type(node.op)](left, right)
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "47*83"
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None
    value = _value(tree.body)
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)

"""The small expression language of mapping files: integer arithmetic on variables and key
captures, read with ``ast`` and evaluated by walking the tree (never ``eval``), so a mapping file
can compute a layer offset or a head count and cannot run code.

Allowed: whole numbers (and, for config documents, decimals, strings, lists), names, ``+ - *
// %``, unary minus, comparisons, ``and or not``, ``a if cond else b``, and the functions
``min``, ``max``, ``get`` (a field of the side's config document), ``shape`` (a tensor's size
along a dimension) and ``count`` (how many source keys a pattern matches). Anything else is
refused when the file is read, naming the text.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptkit.errors import MappingError

__all__ = ["Expr", "parse_expr", "parse_call", "Value"]

Value = int | float | bool | str | list[Any]

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_COMPARE: dict[type, Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}
_FUNCTIONS = ("min", "max", "get", "shape", "count")
_LONGEST = 400  # characters: an expression is a line of a hand-written file
_BIGGEST = 2**62  # a size or an offset beyond this is a mistake, not a model


@dataclass(frozen=True)
class Expr:
    """A parsed expression and the text it came from (for messages)."""

    text: str
    tree: ast.expr

    def names(self) -> set[str]:
        """The variables and captures it reads (not the functions it calls)."""
        called = {id(n.func) for n in ast.walk(self.tree) if isinstance(n, ast.Call)}
        return {
            n.id for n in ast.walk(self.tree) if isinstance(n, ast.Name) and id(n) not in called
        }

    def evaluate(
        self, names: Mapping[str, Value], functions: Mapping[str, Callable[..., Value]] = {}
    ) -> Value:
        """Its value, given ``names`` and the functions ``get`` and ``shape``.

        Raises:
            MappingError: an unknown name, a division by zero, a result too large.
        """
        try:
            return _Walker(self.text, names, functions).value(self.tree)
        except ZeroDivisionError:
            raise MappingError(f"'{self.text}' divides by zero") from None
        except (TypeError, ValueError, OverflowError, RecursionError) as exc:
            # a function given the wrong arguments, a comparison of a text with a number
            raise MappingError(f"'{self.text}' cannot be computed: {exc}") from None

    def as_int(self, names: Mapping[str, Value], functions: Mapping[str, Any] = {}) -> int:
        value = self.evaluate(names, functions)
        if isinstance(value, bool) or not isinstance(value, int):
            raise MappingError(f"'{self.text}' is {value!r}, not a whole number")
        return value

    def __str__(self) -> str:
        return self.text


def parse_expr(text: object, where: str) -> Expr:
    """An expression from a mapping file (a string, or a TOML number).

    Raises:
        MappingError: not an expression of the language, naming ``where``.
    """
    if isinstance(text, bool) or isinstance(text, int | float):
        text = repr(text)
    if not isinstance(text, str) or not text.strip():
        raise MappingError(f"{where}: expected an expression, found {text!r}")
    if len(text) > _LONGEST:
        raise MappingError(f"{where}: the expression is longer than {_LONGEST} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise MappingError(f"{where}: cannot read '{text}' as an expression") from None
    _check(tree, text, where)
    return Expr(text.strip(), tree)


def parse_call(text: object, where: str) -> tuple[str, list[Expr], dict[str, Expr]]:
    """An op of a rule, ``name(arg, key=value)``: its name and its arguments as expressions.

    Raises:
        MappingError: not of that form, naming ``where``.
    """
    if not isinstance(text, str) or len(text) > _LONGEST:
        raise MappingError(f"{where}: an op is written name(arguments), found {text!r}")
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise MappingError(f"{where}: cannot read op '{text}'") from None
    if isinstance(tree, ast.Name):  # an op without arguments may drop its parentheses
        return tree.id, [], {}
    if not isinstance(tree, ast.Call) or not isinstance(tree.func, ast.Name):
        raise MappingError(f"{where}: an op is written name(arguments), found '{text}'")
    if any(k.arg is None for k in tree.keywords):
        raise MappingError(f"{where}: '{text}' unpacks arguments with **, which ops do not take")
    args = []
    for arg in tree.args:
        _check(arg, text, where)
        args.append(Expr(ast.unparse(arg), arg))
    kwargs = {}
    for keyword in tree.keywords:
        assert keyword.arg is not None
        _check(keyword.value, text, where)
        kwargs[keyword.arg] = Expr(ast.unparse(keyword.value), keyword.value)
    return tree.func.id, args, kwargs


def _check(node: ast.AST, text: str, where: str) -> None:
    """Refuse any node outside the language (attribute access, subscripts, lambdas...)."""
    for sub in ast.walk(node):
        ok = (
            isinstance(
                sub,
                ast.Constant
                | ast.Name
                | ast.Load
                | ast.BinOp
                | ast.UnaryOp
                | ast.USub
                | ast.UAdd
                | ast.Not
                | ast.BoolOp
                | ast.And
                | ast.Or
                | ast.Compare
                | ast.IfExp
                | ast.List
                | ast.Call,
            )
            or type(sub) in _BINARY
            or type(sub) in _COMPARE
        )
        if isinstance(sub, ast.Constant) and type(sub.value) not in (int, float, str, bool):
            ok = False
        if isinstance(sub, ast.Call) and not (
            isinstance(sub.func, ast.Name) and sub.func.id in _FUNCTIONS and not sub.keywords
        ):
            ok = False
        if not ok:
            raise MappingError(
                f"{where}: '{text}' uses {type(sub).__name__}, which mapping expressions do not "
                "allow",
                "use numbers, names, + - * // %, comparisons, if/else, min, max, get, shape, count",
            )


class _Walker:
    def __init__(
        self, text: str, names: Mapping[str, Value], functions: Mapping[str, Callable[..., Value]]
    ) -> None:
        self.text, self.names, self.functions = text, names, functions

    def value(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in self.names:
                known = ", ".join(sorted(self.names)) or "none"
                raise MappingError(
                    f"'{self.text}' reads '{node.id}', which is not set (known: {known})",
                    f"set it with --set {node.id}=VALUE",
                )
            return self.names[node.id]
        if isinstance(node, ast.List):
            return [self.value(e) for e in node.elts]
        if isinstance(node, ast.UnaryOp):
            operand = self.value(node.operand)
            if isinstance(node.op, ast.Not):
                return not operand
            return -self._number(operand) if isinstance(node.op, ast.USub) else operand
        if isinstance(node, ast.BinOp):
            left, right = self._number(self.value(node.left)), self._number(self.value(node.right))
            result = _BINARY[type(node.op)](left, right)
            if abs(result) > _BIGGEST:
                raise MappingError(f"'{self.text}' is {result}, beyond any tensor's size")
            return result
        if isinstance(node, ast.BoolOp):
            values = (self.value(v) for v in node.values)
            return all(values) if isinstance(node.op, ast.And) else any(values)
        if isinstance(node, ast.Compare):
            left = self.value(node.left)
            for op, right_node in zip(node.ops, node.comparators, strict=True):
                right = self.value(right_node)
                if not _COMPARE[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.IfExp):
            return self.value(node.body if self.value(node.test) else node.orelse)
        if isinstance(node, ast.Call):
            assert isinstance(node.func, ast.Name)
            args = [self.value(a) for a in node.args]
            if node.func.id in ("min", "max"):
                if not args:
                    raise MappingError(f"'{self.text}': {node.func.id}() of nothing")
                return (min if node.func.id == "min" else max)(self._number(a) for a in args)
            function = self.functions.get(node.func.id)
            if function is None:
                raise MappingError(f"'{self.text}' calls {node.func.id}(), not available here")
            return function(*args)
        raise AssertionError(type(node))  # _check refused it when the file was read

    def _number(self, value: Any) -> int | float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise MappingError(f"'{self.text}': {value!r} is not a number")
        return value

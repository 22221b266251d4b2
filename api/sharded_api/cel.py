"""Expressions over a model's fields that render as Kubernetes CEL and evaluate, with the same meaning, in Python.

The one difference between the two worlds is absence: the API server fills only scalar defaults of
objects that are present, while pydantic fills everything. An `At` (field value) therefore renders
with `has()` guards for every part of its path that may be absent and falls back to the model's
default there; `Has` may only test fields whose default is "unset", where both worlds agree.
"""

from __future__ import annotations

import json
import operator
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

_NO_DEFAULT = object()


# --- what the model says about a path ------------------------------------------------------------


def model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside `X`, `X | None` or `Annotated[X, ...]`, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation) if get_origin(annotation) is not None else ():
        found = model_of(arg)
        if found:
            return found
    return None


def _field_info(model: type[BaseModel] | None, alias: str):
    if model is None:
        return None
    return next((f for name, f in model.model_fields.items() if (f.alias or name) == alias), None)


def _walk(model: type[BaseModel] | None, path: tuple[str, ...]):
    """(field info or None, its model or None) for each segment of `path`."""
    out = []
    for part in path:
        info = _field_info(model, part)
        out.append(info)
        model = model_of(info.annotation) if info else None
    return out


def _literal_default(info) -> Any:
    """A field's default as a JSON literal, or _NO_DEFAULT (none, unset, or an object)."""
    if info is None:
        return _NO_DEFAULT
    if info.default_factory is not None:
        value = info.default_factory()
    elif info.default is PydanticUndefined:
        return _NO_DEFAULT
    else:
        value = info.default
    if value is None or isinstance(value, (dict, BaseModel)):
        return _NO_DEFAULT
    return json.loads(json.dumps(value, default=str))


def _always_present(info) -> bool:
    """Present on the API server whenever its parent is: required, or a scalar default in the schema."""
    if info is None:
        return False
    if info.is_required():
        return True
    return info.default_factory is None and _literal_default(info) is not _NO_DEFAULT


def _cel_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_cel_literal(v) for v in value) + "]"
    return json.dumps(value)


@dataclass(frozen=True)
class Ctx:
    """Rendering context: the model `self` is, paths known present, variables bound by `Each`."""

    model: type[BaseModel] | None
    present: frozenset[tuple[str, ...]] = frozenset()
    bound: dict[str, Any] = field(default_factory=dict)

    def knowing(self, path: tuple[str, ...]) -> Ctx:
        prefixes = {path[: i + 1] for i in range(len(path))}
        return replace(self, present=self.present | prefixes)


# --- expressions --------------------------------------------------------------------------------


class Expr(ABC):
    """A boolean or value expression with a CEL rendering and a Python evaluation."""

    @abstractmethod
    def cel(self, ctx: Ctx) -> str:
        """The expression as CEL, with `self` the object of the model in `ctx`."""

    @abstractmethod
    def eval(self, data: Any, ctx: Ctx) -> Any:
        """The expression's value on `data`, the model's camelCase dump."""

    def __and__(self, other: Expr) -> Expr:
        return And(self, other)

    def __or__(self, other: Expr) -> Expr:
        return Or(self, other)

    def __invert__(self) -> Expr:
        return Not(self)

    def implies(self, other: Expr) -> Expr:
        return Or(Not(self), other)

    def eq(self, v: Any) -> Expr:
        return Cmp("==", self, _expr(v))

    def ne(self, v: Any) -> Expr:
        return Cmp("!=", self, _expr(v))

    def le(self, v: Any) -> Expr:
        return Cmp("<=", self, _expr(v))

    def gt(self, v: Any) -> Expr:
        return Cmp(">", self, _expr(v))

    def is_in(self, v: Any) -> Expr:
        return Cmp("in", self, _expr(v))

    def starts_with(self, prefix: str) -> Expr:
        return Call("startsWith", self, Lit(prefix), lambda a, b: a.startswith(b))

    def matches(self, pattern: str) -> Expr:
        return Call("matches", self, Lit(pattern), lambda a, b: re.search(b, a) is not None)

    def size(self) -> Expr:
        return Unary("size({})", len, self)

    def is_int(self) -> Expr:
        return Unary("type({}) == int", lambda v: isinstance(v, int) and not isinstance(v, bool), self)

    def disjoint(self, other: Expr) -> Expr:
        """No element of this list is in `other`."""
        return Each(self, "c", lambda c: ~c.is_in(other))


def _lookup(data: Any, parts: tuple[str, ...]) -> tuple[bool, Any]:
    """(found, value) at a path of a dump; a None value counts as absent, as exclude_none dumps it."""
    node = data
    for part in parts:
        if not isinstance(node, dict) or node.get(part) is None:
            return False, None
        node = node[part]
    return True, node


def _expr(v: Any) -> Expr:
    return v if isinstance(v, Expr) else Lit(v)


@dataclass(frozen=True, eq=False)
class Lit(Expr):
    value: Any

    def cel(self, ctx: Ctx) -> str:
        return _cel_literal(self.value)

    def eval(self, data: Any, ctx: Ctx) -> Any:
        return self.value


@dataclass(frozen=True, eq=False)
class At(Expr):
    """The value at a dotted camelCase path under `self`, or the model's default where it may be absent."""

    path: str

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(self.path.split("."))

    def _guards(self, ctx: Ctx) -> list[tuple[str, ...]]:
        infos, parts = _walk(ctx.model, self.parts), self.parts
        prefixes = [parts[: i + 1] for i in range(len(parts))]
        absent = [p for p, info in zip(prefixes, infos, strict=True) if not _always_present(info)]
        return [p for p in absent if p not in ctx.present]

    def _fallback(self, ctx: Ctx) -> Any:
        value = _literal_default(_walk(ctx.model, self.parts)[-1])
        if value is _NO_DEFAULT:
            raise ValueError(f"{self.path} may be absent and has no default: guard it with Has({self.path!r})")
        return value

    def cel(self, ctx: Ctx) -> str:
        guards = self._guards(ctx)
        access = "self." + self.path
        if not guards:
            return access
        test = " && ".join("has(self." + ".".join(g) + ")" for g in guards)
        return f"({test} ? {access} : {_cel_literal(self._fallback(ctx))})"

    def eval(self, data: Any, ctx: Ctx) -> Any:
        found, value = _lookup(data, self.parts)
        return value if found else self._fallback(ctx)


@dataclass(frozen=True, eq=False)
class Has(Expr):
    """Whether an optional field (default unset) is set."""

    path: str

    def cel(self, ctx: Ctx) -> str:
        parts = tuple(self.path.split("."))
        infos = _walk(ctx.model, parts)
        info = infos[-1]
        if info is not None and (info.is_required() or info.default_factory is not None or info.default is not None):
            raise ValueError(f"Has({self.path!r}): the field has a default, so it is always set in Python")
        tests = [p for p in (parts[: i + 1] for i in range(len(parts))) if p not in ctx.present]
        return " && ".join("has(self." + ".".join(p) + ")" for p in tests) or "true"

    def eval(self, data: Any, ctx: Ctx) -> Any:
        return _lookup(data, tuple(self.path.split(".")))[0]


@dataclass(frozen=True, eq=False)
class Not(Expr):
    a: Expr

    def cel(self, ctx: Ctx) -> str:
        inner = self.a.cel(ctx)
        return f"!{inner}" if " " not in inner else f"!({inner})"

    def eval(self, data: Any, ctx: Ctx) -> Any:
        return not self.a.eval(data, ctx)


def _known(e: Expr, negated: bool) -> tuple[str, ...] | None:
    """The path a guard makes present for the other side: `has(x) && ...` or `!has(x) || ...`."""
    if negated and isinstance(e, Not) and isinstance(e.a, Has):
        return tuple(e.a.path.split("."))
    if not negated and isinstance(e, Has):
        return tuple(e.path.split("."))
    return None


@dataclass(frozen=True, eq=False)
class Logic(Expr):
    """`a && b` or `a || b`. A guard on the left (`has(x) && ...`, `!has(x) || ...`) makes x present on the right."""

    op: str  # "&&" or "||"
    a: Expr
    b: Expr

    def cel(self, ctx: Ctx) -> str:
        known = _known(self.a, negated=self.op == "||")
        return f"({self.a.cel(ctx)} {self.op} {self.b.cel(ctx.knowing(known) if known else ctx)})"

    def eval(self, data: Any, ctx: Ctx) -> Any:
        left = bool(self.a.eval(data, ctx))
        if left == (self.op == "||"):  # short-circuit, as CEL does for a decided side
            return left
        return bool(self.b.eval(data, ctx))


def And(a: Expr, b: Expr) -> Expr:
    return Logic("&&", a, b)


def Or(a: Expr, b: Expr) -> Expr:
    return Logic("||", a, b)


_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "==": operator.eq, "!=": operator.ne, "<=": operator.le, ">": operator.gt, "in": lambda a, b: a in b,
}  # fmt: skip


@dataclass(frozen=True, eq=False)
class Cmp(Expr):
    op: str
    a: Expr
    b: Expr

    def cel(self, ctx: Ctx) -> str:
        return f"{self.a.cel(ctx)} {self.op} {self.b.cel(ctx)}"

    def eval(self, data: Any, ctx: Ctx) -> Any:
        return _OPS[self.op](self.a.eval(data, ctx), self.b.eval(data, ctx))


@dataclass(frozen=True, eq=False)
class Call(Expr):
    """A CEL string method, `a.name(b)`, and its Python equivalent."""

    name: str
    a: Expr
    b: Expr
    fn: Callable[[Any, Any], bool]

    def cel(self, ctx: Ctx) -> str:
        return f"{self.a.cel(ctx)}.{self.name}({self.b.cel(ctx)})"

    def eval(self, data: Any, ctx: Ctx) -> Any:
        return self.fn(self.a.eval(data, ctx), self.b.eval(data, ctx))


@dataclass(frozen=True, eq=False)
class Unary(Expr):
    """A function of one value: its CEL template (`{}` is the argument) and its Python equivalent."""

    template: str
    fn: Callable[[Any], Any]
    a: Expr

    def cel(self, ctx: Ctx) -> str:
        return self.template.format(self.a.cel(ctx))

    def eval(self, data: Any, ctx: Ctx) -> Any:
        return self.fn(self.a.eval(data, ctx))


@dataclass(frozen=True, eq=False)
class Var(Expr):
    """An element bound by `Each`; `.field(name)` reads one of its (required) fields."""

    name: str
    attr: str | None = None

    def field(self, attr: str) -> Var:
        return Var(self.name, attr)

    def cel(self, ctx: Ctx) -> str:
        return self.name + (f".{self.attr}" if self.attr else "")

    def eval(self, data: Any, ctx: Ctx) -> Any:
        value = ctx.bound[self.name]
        return value[self.attr] if self.attr else value


@dataclass(frozen=True, eq=False)
class Each(Expr):
    """`body(element)` holds for every element of a list."""

    items: Expr
    var: str
    body_of: Callable[[Var], Expr]

    def cel(self, ctx: Ctx) -> str:
        return f"{self.items.cel(ctx)}.all({self.var}, {self.body_of(Var(self.var)).cel(ctx)})"

    def eval(self, data: Any, ctx: Ctx) -> Any:
        body = self.body_of(Var(self.var))
        return all(body.eval(data, replace(ctx, bound={**ctx.bound, self.var: v})) for v in self.items.eval(data, ctx))

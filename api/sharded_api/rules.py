"""Validation rules written once: each renders the CEL rule the API server runs and checks the same in Python.

A rule is an expression (`sharded_api.cel`) over the fields of the model it is attached to
(`rules` on the class). It renders to an `x-kubernetes-validations` entry for the CRD and evaluates
on the model's camelCase dump, so an object that reaches the operator past an older CRD fails with the
same message.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic.alias_generators import to_camel

from sharded_api.cel import At, Call, Cmp, Ctx, Each, Expr, Has, Logic, Not, Unary


@dataclass(frozen=True)
class Rule:
    """One constraint: where its error points, what it says, the check, and examples either side of it.

    `good` and `bad` are partial objects of the model the rule is attached to (camelCase; a None value
    removes a key); tests run every one through the API server and through the Python check.
    """

    field: str  # dotted path under the model that the error names; "" for the object as a whole
    message: str
    check: Expr
    good: tuple[dict, ...] = ()
    bad: tuple[dict, ...] = ()

    def to_cel(self, model: type[BaseModel]) -> dict[str, Any]:
        out: dict[str, Any] = {"rule": self.check.cel(Ctx(model)), "message": self.message}
        if self.field:
            out["fieldPath"] = "." + self.field
        return out

    def holds(self, data: dict[str, Any], model: type[BaseModel]) -> bool:
        return bool(self.check.eval(data, Ctx(model)))

    def error(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message

    def rebased(self, roots: dict[str, str], context: dict | None = None) -> Rule:
        """The same rule on a model that holds this one's fields under other paths ({old root: new}); its
        examples are set into `context` (fields the larger model's other rules need)."""

        def move(path: str) -> str:
            head, _, rest = path.partition(".")
            return roots[head] + ("." + rest if rest else "") if head in roots else path

        def move_example(ex: dict) -> dict:
            out: dict = copy.deepcopy(context or {})
            for k, v in ex.items():
                node, *parents, leaf = [out, *move(k).split(".")]
                for p in parents:
                    node = node.setdefault(p, {})
                node[leaf] = v
            return out

        return Rule(
            field=move(self.field), message=self.message, check=_rebase(self.check, move),
            good=tuple(move_example(e) for e in self.good), bad=tuple(move_example(e) for e in self.bad),
        )  # fmt: skip


def _rebase(e: Expr, move: Callable[[str], str]) -> Expr:
    if isinstance(e, (At, Has)):
        return type(e)(move(e.path))
    if isinstance(e, Each):
        return Each(_rebase(e.items, move), e.var, lambda v: _rebase(e.body_of(v), move))
    if isinstance(e, Call):
        return Call(e.name, _rebase(e.a, move), _rebase(e.b, move), e.fn)
    if isinstance(e, Cmp):
        return Cmp(e.op, _rebase(e.a, move), _rebase(e.b, move))
    if isinstance(e, Logic):
        return Logic(e.op, _rebase(e.a, move), _rebase(e.b, move))
    if isinstance(e, Not):
        return Not(_rebase(e.a, move))
    if isinstance(e, Unary):
        return Unary(e.template, e.fn, _rebase(e.a, move))
    return e


class RuleViolation(ValueError):
    """Rules a model broke; error formatting places each under its own field, as the API server does."""

    def __init__(self, broken: list[Rule]):
        super().__init__("; ".join(r.error() for r in broken))
        self.broken = broken


def _schema_rules(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    """pydantic's json_schema_extra hook: the class's rules become its CEL validations."""
    validations = [r.to_cel(cls) for r in getattr(cls, "rules", ())] + list(getattr(cls, "transition_rules", ()))
    validations += list(getattr(cls, "raw_rules", ()))
    if validations:
        schema.setdefault("x-kubernetes-validations", []).extend(validations)
    if cls.model_config.get("extra") == "allow":  # an object modelled in part (a core/v1 Container): keep the rest
        schema["x-kubernetes-preserve-unknown-fields"] = True


class Ruled(BaseModel):
    """A model whose `rules` land in its JSON schema as CEL and are checked after validation in Python.

    `transition_rules` (CEL dicts using `oldSelf`) go to the schema only: Python never sees the old object;
    `raw_rules` (CEL dicts the expression language cannot write) too, each with its own check in Python.
    """

    model_config = ConfigDict(json_schema_extra=_schema_rules)
    rules: ClassVar[tuple[Rule, ...]] = ()
    raw_rules: ClassVar[tuple[dict[str, str], ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self):
        if self.rules:
            data = self.model_dump(by_alias=True, exclude_none=True, mode="json")
            broken = [r for r in self.rules if not r.holds(data, type(self))]
            if broken:
                raise RuleViolation(broken)
        return self


class Model(Ruled):
    """Base for every config and API model: camelCase on the wire, unknown keys rejected, `rules` checked."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", validate_assignment=True)

"""Every validation rule's own examples, placed in a whole job: the cases both tiers run (Python and API server)."""

from __future__ import annotations

import copy
from typing import Any, get_origin

from pydantic import BaseModel

from sharded_api.cel import model_of
from sharded_api.rules import Rule
from sharded_operator.api.models import ShardedTrainingJob
from support.manifests import load_example


def models_in_job() -> list[tuple[str, type[BaseModel]]]:
    """(path from the job's root, model) for every model a job is made of, the job itself first."""
    found: list[tuple[str, type[BaseModel]]] = []

    def visit(path: str, model: type[BaseModel]) -> None:
        if any(m is model for _, m in found):
            return
        found.append((path, model))
        for name, info in model.model_fields.items():
            sub = model_of(info.annotation)
            if sub is not None:  # a list of models is marked `[]`: an example is then the list's one element
                many = "[]" if get_origin(info.annotation) is list else ""
                visit(f"{path}.{info.alias or name}{many}".lstrip("."), sub)

    visit("", ShardedTrainingJob)
    return found


def merged(base: dict, path: str, example: dict) -> dict:
    """`base` with `example` merged in at `path`; a None in the example removes that key."""
    out = copy.deepcopy(base)
    node = out
    for part in filter(None, path.split(".")):
        node = node.setdefault(part[:-2], [{}])[0] if part.endswith("[]") else node.setdefault(part, {})

    def merge(into: dict, changes: dict) -> None:
        for k, v in changes.items():
            if v is None:
                into.pop(k, None)
            elif isinstance(v, dict) and isinstance(into.get(k), dict):
                merge(into[k], v)
            else:
                into[k] = copy.deepcopy(v)

    merge(node, example)
    return out


def rule_cases() -> list[tuple[str, Rule, dict[str, Any], bool]]:
    """(id, rule, whole job, whether the rule holds) for every example of every rule of a job's models."""
    cases = []
    for path, model in models_in_job():
        for i, rule in enumerate(model.__dict__.get("rules", ())):
            for verdict, examples in ((True, rule.good), (False, rule.bad)):
                for j, example in enumerate(examples):
                    name = f"{model.__name__}-{rule.field or 'object'}-{i}-{'good' if verdict else 'bad'}{j}"
                    cases.append((name, rule, merged(load_example(), path, example), verdict))
    return cases

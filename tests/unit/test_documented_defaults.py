"""A default the README or docs/ state for a field is the default the code has: each `field` written with
its default beside it (`a.b`, default `X` / `a.b` (default X) / `a.b` (N)) is looked up in the generated
CRD (the job's spec, and the trainer config inside it) or the chart's values.yaml, and compared."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "training.sharded.dev_shardedtrainingjobs.yaml"
VALUES = ROOT / "charts" / "sharded-training-operator" / "values.yaml"
# The benchmarks report measured counts beside names, not defaults.
BENCHMARKS = ("benchmarks.md", "benchmarks-history.md")
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in BENCHMARKS)]
# `field`, default `X` | `field` (default `X` ... | `field` (default X | `field` (N)
STATED = re.compile(
    r"`(?P<path>[a-z][a-zA-Z0-9]*(?:\.[a-zA-Z][a-zA-Z0-9]*)*)`"
    r"(?:, default `(?P<a>[^`]+)`| \(default `(?P<b>[^`]+)`| \(default (?P<c>[0-9][0-9.]*)\b| \((?P<d>[0-9][0-9.]*)\))"
)


def statements() -> list[tuple[str, str, str]]:
    """(where, field path, stated default) for every statement in the README and docs/."""
    out = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for m in STATED.finditer(line):
                value = next(v for v in m.group("a", "b", "c", "d") if v is not None)
                out.append((f"{doc.relative_to(ROOT)}:{n}", m["path"], value))
    return out


def _schema_default(schema: dict, path: list[str]):
    for key in path:
        props = schema.get("properties") or {}
        if key not in props:
            return KeyError
        schema = props[key]
    return schema.get("default", KeyError)


def _leaves(schema: dict, name: str):
    """Every field called `name` anywhere under `schema` (a doc may name a field without its parents)."""
    for key, sub in (schema.get("properties") or {}).items():
        if key == name:
            yield sub
        yield from _leaves(sub, name)
        yield from _leaves(sub.get("items") or {}, name)


def code_default(path: str):
    """The default the code gives `path`: the CRD's job spec, the trainer config in it, or the chart's values;
    a bare name (no dots) may be any field of the spec that has that name, if only one does."""
    spec = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    parts = path.split(".")
    for root in (spec, (spec.get("properties") or {}).get("trainer") or {}):
        if (found := _schema_default(root, parts)) is not KeyError:
            return found
    if len(parts) == 1 and len(named := list(_leaves(spec, path))) == 1:
        return named[0].get("default", KeyError)
    values = yaml.safe_load(VALUES.read_text())
    for key in parts:
        if not isinstance(values, dict) or key not in values:
            return KeyError
        values = values[key]
    return values


def same(stated: str, default) -> bool:
    parsed = yaml.safe_load(stated)
    if isinstance(default, list) and not isinstance(parsed, list):
        parsed = [parsed]
    return parsed == default or json.dumps(parsed) == json.dumps(default)


def test_the_docs_state_defaults_at_all():
    assert len(statements()) >= 8  # the pattern still finds what the docs write


@pytest.mark.parametrize("where,path,stated", statements(), ids=lambda v: v if ":" in str(v) else None)
def test_a_documented_default_is_the_codes(where, path, stated):
    default = code_default(path)
    assert default is not KeyError, f"{where}: `{path}` is no field of the job, its trainer config or chart values"
    assert same(stated, default), f"{where}: says `{path}` defaults to {stated}, the code has {default!r}"

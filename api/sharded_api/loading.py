"""A trainer config read from its file, with `key.path=value` overrides, validated; errors that name every
offending field, the way the API server writes its paths."""

from __future__ import annotations

import yaml
from pydantic import ValidationError

from sharded_api.config import TrainerConfig
from sharded_api.rules import RuleViolation


class ConfigError(ValueError):
    """A config a user wrote is invalid; the message names every offending field."""


def format_validation_error(err: ValidationError, prefix: str = "") -> str:
    """One line per problem: `field.path: message (got value)`."""
    lines = []
    for e in err.errors():
        # list positions as the API server writes them: spec.pod.sidecars[0].image
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e["loc"]).lstrip(".")
        violation = (e.get("ctx") or {}).get("error")
        if isinstance(violation, RuleViolation):  # each rule names its own field under the model's
            lines += [f"{prefix}{'.'.join(p for p in (loc, r.field) if p)}: {r.message}" for r in violation.broken]
            continue
        got = "" if e["type"] in ("missing", "value_error") else f" (got {e.get('input')!r})"
        msg = e["msg"].removeprefix("Value error, ")
        where = f"{prefix}{loc}: " if loc else prefix
        lines.append(f"{where}{msg}{got}")
    return "\n".join(lines)


def load_config(path: str, overrides: list[str] | None = None) -> TrainerConfig:
    """Read a YAML/JSON config file, apply `a.b=value` overrides, validate. Raises ConfigError."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping, got {type(raw).__name__}")
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must look like key.path=value (e.g. steps=20)")
        node = raw
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p} is not a mapping")
        node[parts[-1]] = yaml.safe_load(value)
    try:
        return TrainerConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"invalid trainer config {path}:\n{format_validation_error(e)}") from e

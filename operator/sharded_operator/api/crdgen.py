"""Generates the ShardedTrainingJob CRD from the pydantic models (`make crds`); never edit crds/ by hand."""

from __future__ import annotations

import copy
import sys
from typing import Any

import yaml

from sharded_operator.api import models

# Keys a Kubernetes structural schema accepts; everything else pydantic emits (title, $defs, ...) goes.
_KEEP = {
    "type", "properties", "items", "required", "description", "enum", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "pattern", "minItems", "maxItems",
    "uniqueItems", "format", "default", "additionalProperties", "nullable",
}  # fmt: skip


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        if "$ref" in node:
            target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
            extra = {k: v for k, v in node.items() if k != "$ref"}
            return _resolve({**target, **extra}, defs)
        return {k: _resolve(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve(v, defs) for v in node]
    return node


def structural(node: dict[str, Any]) -> dict[str, Any]:
    """Turn one resolved pydantic JSON-schema node into a Kubernetes structural schema node."""
    node = dict(node)
    if node.get("x-kubernetes-int-or-string"):
        # int | str (or int | "auto"): the API server wants the marker, not anyOf.
        out: dict[str, Any] = {"x-kubernetes-int-or-string": True}
        for k in ("description", "x-kubernetes-validations"):
            if k in node:
                out[k] = node[k]
        if isinstance(node.get("default"), (int, str)):
            out["default"] = node["default"]
        return out
    if "anyOf" in node:  # Optional[X] -> X; the field is simply not required
        branches = [b for b in node.pop("anyOf") if b.get("type") != "null"]
        if len(branches) != 1:
            raise ValueError(f"unsupported union in CRD schema: {branches}")
        merged = {**branches[0], **{k: v for k, v in node.items() if k != "default" or v is not None}}
        return structural(merged)
    if "allOf" in node and len(node["allOf"]) == 1:
        return structural({**node.pop("allOf")[0], **node})
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for bound in ("exclusiveMinimum", "exclusiveMaximum"):
        if isinstance(node.get(bound), (int, float)) and not isinstance(node.get(bound), bool):
            if node[bound] != int(node[bound]):
                # The API server checks an integer value (a defaulted 0.0 reaches it as 0) against an exclusive
                # bound as integers: 0 is then not below int(0.5). Inclusive bounds compare correctly.
                raise ValueError(f"exclusive bound {node[bound]} is not a whole number: the API server would "
                                 "truncate it for integer values; use an inclusive bound (ge/le)")  # fmt: skip
            node[bound.replace("exclusiveM", "m")] = node[bound]
            node[bound] = True
    out = {k: v for k, v in node.items() if k in _KEEP or k.startswith("x-kubernetes-")}
    # Object defaults stay with the models: nested scalar defaults already fill any object the user
    # writes, and a whole default object would print every option on every job.
    if isinstance(out.get("default"), dict) or out.get("default") is None:
        out.pop("default", None)
    if out.get("type") == "object" or "properties" in out:
        out["type"] = "object"
        if "properties" in out:
            out["properties"] = {k: structural(v) for k, v in out["properties"].items()}
            out.pop("additionalProperties", None)
        ap = out.get("additionalProperties")
        if ap is True or ("properties" not in out and ap is None):
            out.pop("additionalProperties", None)
            out["x-kubernetes-preserve-unknown-fields"] = True
        elif isinstance(ap, dict):
            out["additionalProperties"] = structural(ap)
    if out.get("type") == "array":
        out["items"] = structural(out.get("items", {"type": "object", "additionalProperties": True}))
    return out


def schema_of(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return structural(_resolve(raw, defs))


def build_crd() -> dict[str, Any]:
    spec = schema_of(models.ShardedTrainingJobSpec)
    status = schema_of(models.ShardedTrainingJobStatus)
    status.pop("x-kubernetes-validations", None)
    root = {
        "type": "object",
        "description": "A multi-node sharded (FSDP2 or DeepSpeed ZeRO-2) training job run by torchrun.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "APIVersion of this object."},
            "kind": {"type": "string", "description": "Kind of this object."},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
        "x-kubernetes-validations": [r.to_cel(models.ShardedTrainingJob) for r in models.ShardedTrainingJob.rules],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{models.PLURAL}.{models.GROUP}",
            "annotations": {"training.sharded.dev/generated-by": "sharded_operator.api.crdgen (make crds)"},
        },
        "spec": {
            "group": models.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": models.KIND,
                "listKind": f"{models.KIND}List",
                "plural": models.PLURAL,
                "singular": models.KIND.lower(),
                "shortNames": [models.SHORT_NAME],
                "categories": ["all", "training"],
            },
            "versions": [
                {
                    "name": models.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": models.PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def render() -> str:
    header = "# Generated by `make crds` from operator/sharded_operator/api/models.py. Do not edit.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=120, allow_unicode=True)


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())

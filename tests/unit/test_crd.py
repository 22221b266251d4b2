"""crds/ is generated from the models and never drifts from them."""

from __future__ import annotations

import pytest
import yaml

from conftest import CRD_FILE
from sharded_operator.api import crdgen


def test_crd_file_matches_the_models():
    assert CRD_FILE.read_text() == crdgen.render(), (
        "crds/ is out of date with operator/sharded_operator/api/models.py: run `make crds` and commit the result"
    )


def walk(schema, path=""):
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from walk(sub, f"{path}.{name}")
    if "items" in schema:
        yield from walk(schema["items"], f"{path}[]")


def test_crd_schema_is_structural_and_documented():
    crd = yaml.safe_load(CRD_FILE.read_text())
    version = crd["spec"]["versions"][0]
    root = version["schema"]["openAPIV3Schema"]
    for path, node in walk(root["properties"]["spec"], "spec"):
        assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
        assert node.get("description") or path.endswith("[]"), f"{path} has no description"
        assert (
            "type" in node or node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
        ), f"{path} has no type"
    assert version["subresources"] == {"status": {}}
    assert crd["spec"]["names"]["shortNames"] == ["stj"]
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == [
        "Phase", "Ready", "Nodes", "Desired", "Strategy", "Step", "Loss", "Restarts", "Checkpoint", "Age"
    ]  # fmt: skip


def test_cel_rules_are_present_for_cross_field_constraints():
    crd = yaml.safe_load(CRD_FILE.read_text())
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec_rules = " ".join(r["rule"] for r in root["properties"]["spec"]["x-kubernetes-validations"])
    assert "elastic.minNodes <= self.nodes" in spec_rules
    assert "oldSelf.strategy.type" in spec_rules
    assert any("metadata.name" in r["rule"] for r in root["x-kubernetes-validations"])


def test_a_fractional_exclusive_bound_is_refused_for_the_api_servers_integer_comparison():
    """The API server compared a defaulted 0.0 (sent as the integer 0) with `exclusiveMaximum: 0.5` as integers
    and refused it as not below 0: the generator takes no fractional exclusive bound."""
    with pytest.raises(ValueError, match=r"exclusive bound 0\.5 is not a whole number"):
        crdgen.structural({"type": "number", "default": 0.0, "exclusiveMaximum": 0.5})
    assert crdgen.structural({"type": "number", "exclusiveMaximum": 1})["maximum"] == 1

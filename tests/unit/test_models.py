"""The pydantic models mirror the CRD's admission rules, so a slipped-through object fails the same way."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sharded_api.loading import format_validation_error
from sharded_operator.api.models import ShardedTrainingJob
from support.manifests import EXAMPLES, MALFORMED, load_example, mutate


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_is_a_valid_job(path):
    import yaml

    job = ShardedTrainingJob.model_validate(yaml.safe_load(path.read_text()))
    assert job.spec.image


@pytest.mark.parametrize(
    "case,changes,field",
    [m for m in MALFORMED if not m[2].startswith("metadata")],
    ids=[m[0] for m in MALFORMED if not m[2].startswith("metadata")],
)
def test_malformed_spec_is_refused_by_the_models_naming_the_field(case, changes, field):
    with pytest.raises(ValidationError) as exc:
        ShardedTrainingJob.model_validate(mutate(load_example(), changes))
    message = format_validation_error(exc.value)
    leaf = field.removeprefix("spec.")
    # Either the error's location is the field, or (cross-field rules) the message names it.
    assert field in message or leaf in message, message


def test_defaults_fill_an_almost_empty_spec():
    job = ShardedTrainingJob.model_validate({"metadata": {"name": "x"}, "spec": {"image": "img"}})
    assert job.spec.nodes == 1
    assert job.spec.procs_per_node == "auto"
    assert job.spec.strategy.type == "fsdp"
    assert job.spec.failure_policy.permanent_exit_codes == [2, 4]
    assert job.spec.checkpoint is None


def test_wire_format_is_camel_case_and_round_trips():
    raw = load_example()
    job = ShardedTrainingJob.model_validate(raw)
    dumped = job.spec.model_dump(by_alias=True, exclude_none=True)
    assert dumped["procsPerNode"] == 2
    assert dumped["checkpoint"]["keepLast"] == 2
    assert ShardedTrainingJob.model_validate({"spec": dumped}).spec == job.spec

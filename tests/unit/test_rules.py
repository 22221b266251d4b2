"""Validation rules declared once: each has examples either side, renders CEL, and holds or not in Python."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sharded_api.cel import At, Ctx, Has
from sharded_api.config import TrainerConfig
from sharded_api.loading import format_validation_error
from sharded_api.rules import Rule
from sharded_operator.api import crdgen
from sharded_operator.api.models import ShardedTrainingJob, ShardedTrainingJobSpec
from support.rule_cases import models_in_job, rule_cases

CASES = rule_cases()


def python_errors(job: dict) -> str:
    try:
        ShardedTrainingJob.model_validate(job)
    except ValidationError as e:
        return format_validation_error(e)
    return ""


def test_every_rule_has_an_example_either_side():
    rules = [r for _, m in models_in_job() for r in m.__dict__.get("rules", ())] + list(TrainerConfig.rules)
    assert len(rules) >= 12
    for rule in rules:
        assert rule.good and rule.bad, f"{rule.field}: {rule.message} needs good and bad examples"


@pytest.mark.parametrize("case,rule,job,holds", CASES, ids=[c[0] for c in CASES])
def test_the_python_check_agrees_with_the_examples(case, rule, job, holds):
    errors = python_errors(job)
    if holds:
        assert errors == "", errors
    else:
        assert rule.message in errors, errors


@pytest.mark.parametrize("rule", TrainerConfig.rules, ids=lambda r: r.field)
def test_trainer_config_rules_hold_on_the_trainer_config_too(rule):
    """The trainer checks its own config with the same rules the spec carries, before any process starts."""
    for example in rule.good:
        TrainerConfig.model_validate(example)
    for example in rule.bad:
        with pytest.raises(ValidationError) as exc:
            TrainerConfig.model_validate(example)
        assert f"{rule.field}: {rule.message}" in format_validation_error(exc.value)


def test_the_spec_carries_the_trainer_rules_with_its_own_paths():
    fp16 = next(r for r in ShardedTrainingJobSpec.rules if r.message == TrainerConfig.rules[0].message)
    assert fp16.field == "trainer.precision"
    assert fp16.bad[0] == {
        "trainer": {"precision": "fp16"}, "strategy": {"type": "fsdp"}, "resources": {"gpusPerNode": 8}
    }  # fmt: skip


def test_every_rule_lands_in_the_crd_once():
    crd = crdgen.render()
    for _, model in models_in_job():
        for rule in model.__dict__.get("rules", ()):
            assert crd.count(rule.to_cel(model)["rule"].split(" ")[0]) >= 1
    messages = [r.message for _, m in models_in_job() for r in m.__dict__.get("rules", ())]
    assert len(messages) == len(set(messages)), "two rules with one message cannot be told apart in errors"


def test_a_field_that_may_be_absent_on_the_api_server_is_guarded_with_its_default():
    cel = At("strategy.type").eq("fsdp").cel(Ctx(ShardedTrainingJobSpec))
    assert cel == "(has(self.strategy) ? self.strategy.type : 'fsdp') == 'fsdp'"
    # Scalars with a schema default are filled in by the API server: no guard.
    assert At("nodes").cel(Ctx(ShardedTrainingJobSpec)) == "self.nodes"


def test_a_guard_makes_its_path_present_for_the_rest_of_the_rule():
    cel = Has("elastic").implies(At("elastic.minNodes").le(At("nodes"))).cel(Ctx(ShardedTrainingJobSpec))
    assert cel == "(!has(self.elastic) || self.elastic.minNodes <= self.nodes)"


def test_an_unguarded_optional_field_without_default_is_refused_when_rendered():
    with pytest.raises(ValueError, match="guard it with Has"):
        At("elastic.minNodes").cel(Ctx(ShardedTrainingJobSpec))
    with pytest.raises(ValueError, match="always set in Python"):
        Has("strategy").cel(Ctx(ShardedTrainingJobSpec))


def test_rebasing_moves_paths_and_examples():
    rule = Rule("a", "m", At("a").ne(1), good=({"a": 2},), bad=({"a": 1, "b": 3},))
    moved = rule.rebased({"a": "x.a"})
    assert moved.field == "x.a" and moved.bad == ({"x": {"a": 1}, "b": 3},)

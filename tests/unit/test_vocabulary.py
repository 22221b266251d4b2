"""Every vocabulary has one home: reasons and event types in `api/reasons.py`, job and pod phases and condition
types in `api/status.py`. Any other module of the operator that writes one as a literal is a stray (a typo in a
reason is invisible until an alert that filters on it stays silent)."""

from __future__ import annotations

from pathlib import Path

from test_contract import string_literals

from sharded_operator.api.reasons import EventType, Reason
from sharded_operator.api.status import ConditionType, Phase, PodPhase

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "operator" / "sharded_operator"
HOMES = {"api/reasons.py", "api/status.py"}
WORDS = {e.value for vocabulary in (Reason, EventType, Phase, PodPhase, ConditionType) for e in vocabulary}
# Words of another vocabulary that happen to equal one of ours, where the code reads what they belong to.
OTHERS = {
    ("api/spec.py", "Running"): "a value of spec.runPolicy.cleanPodPolicy",
    ("decide/lifecycle.py", "Running"): "a value of spec.runPolicy.cleanPodPolicy",
    ("decide/views.py", "DisruptionTarget"): "the pod condition type the Eviction API and the kubelet set",
}


def strays(package: Path) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel in HOMES:
            continue
        found += [f"{rel}:{line}: {text!r}" for line, text in string_literals(path)
                  if text in WORDS and (rel, text) not in OTHERS]  # fmt: skip
    return found


def test_no_module_but_the_vocabularies_writes_a_reason_or_a_phase():
    found = strays(PACKAGE)
    assert not found, "write these through api/reasons.py or api/status.py:\n" + "\n".join(found)


def test_the_scan_finds_a_planted_reason_and_phase(tmp_path):
    (tmp_path / "decide").mkdir()
    (tmp_path / "decide" / "planted.py").write_text(
        '"""Says WaitingForOldPods in prose."""\n'
        'reason = "WaitingForOldPods"\nfinished = phase == "Succeeded"\nmessage = "pods Running: 2"\n'
    )
    assert strays(tmp_path) == ["decide/planted.py:2: 'WaitingForOldPods'", "decide/planted.py:3: 'Succeeded'"]


def test_every_word_named_as_another_vocabularys_is_still_used_there():
    """An entry of OTHERS that no longer matches a literal is stale: the exemption would hide a new stray."""
    for (rel, word), why in OTHERS.items():
        texts = {text for _, text in string_literals(PACKAGE / rel)}
        assert word in texts, f"{rel} no longer writes {word!r} ({why}): drop it from OTHERS"


def test_reasons_are_distinct_camel_case_words():
    values = [r.value for r in Reason]
    assert len(values) == len(set(values))
    assert all(v[0].isupper() and v.isalpha() for v in values), values

"""The checkpoint fence under any timing: a writer that stalls between its generation check and its rename
(or its purge) can never replace or remove a newer generation's checkpoint, and a resume continues the
newest generation's line. The filesystem operations are driven directly, the stall injected at the rename."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sharded_api.contract import MARKER, step_dir_name
from sharded_trainer.checkpoint import fence
from sharded_trainer.checkpoint.fence import ASIDE_INFIX, Superseded, committed_by, install, remove
from sharded_trainer.checkpoint.manager import committed_steps


def save(root: Path, step: int, generation: int, payload: str = "") -> Path:
    """A complete save of `step` by `generation`, in its writing directory, as a writer has it at its commit."""
    writing = root / f"{step_dir_name(step)}.g{generation}"
    writing.mkdir(parents=True)
    (writing / "shard.distcp").write_text(payload or f"gen {generation} step {step}")
    (writing / MARKER).write_text(json.dumps({"step": step, "generation": generation}))
    return writing


def test_a_commit_replaces_an_older_generations_save_of_the_step_and_never_a_newer_ones(tmp_path):
    target = tmp_path / step_dir_name(40)
    install(save(tmp_path, 40, 1), target, 1)
    assert committed_by(target) == 1
    install(save(tmp_path, 40, 2), target, 2)  # the next attempt saves the same step: its own wins
    assert committed_by(target) == 2
    late = save(tmp_path, 40, 1, "the zombie's")
    with pytest.raises(Superseded) as e:
        install(late, target, 1)
    assert e.value.newer == 2 and (target / "shard.distcp").read_text() == "gen 2 step 40"
    assert not list(tmp_path.glob(f"*{ASIDE_INFIX}*"))


def test_a_zombie_frozen_between_its_check_and_its_rename_cannot_commit_over_the_new_attempt(tmp_path):
    """The zombie (generation 1) passed its generation check and froze; generation 2 started, resumed and
    committed the same step; the zombie wakes at its rename. The resume continues generation 2's checkpoint."""
    target = tmp_path / step_dir_name(40)
    zombie = save(tmp_path, 40, 1, "the zombie's")  # checked: no newer generation yet; then frozen
    install(save(tmp_path, 40, 2), target, 2)  # meanwhile the new attempt commits step 40
    with pytest.raises(Superseded):
        install(zombie, target, 1)  # the zombie wakes: its rename lands on a newer generation's checkpoint
    assert (target / "shard.distcp").read_text() == "gen 2 step 40" and committed_steps(tmp_path) == [40]


def test_a_look_that_went_stale_before_the_move_puts_the_newer_checkpoint_back(tmp_path, monkeypatch):
    """The zombie's purge looks at step 30 (its own generation's: removable), stalls, and generation 2
    replaces step 30 before the zombie's rename: what the zombie moved is judged, found newer, put back."""
    target = tmp_path / step_dir_name(30)
    install(save(tmp_path, 30, 1), target, 1)
    real_rename = os.rename
    stalled = []

    def rename(src, dst):
        if not stalled and Path(src) == target and ASIDE_INFIX in Path(dst).name:
            stalled.append(1)  # the zombie, between its look and its move: generation 2 commits step 30
            install(save(tmp_path, 30, 2), target, 2)
        return real_rename(src, dst)

    monkeypatch.setattr(fence.os, "rename", rename)
    assert remove(target, 1) is False
    assert committed_by(target) == 2 and (target / "shard.distcp").read_text() == "gen 2 step 30"
    assert not list(tmp_path.glob(f"*{ASIDE_INFIX}*"))
    assert remove(target, 2) is True and not target.exists()  # its own generation may remove it


def test_the_newest_generations_line_is_resumed_even_when_a_stale_writer_committed_a_later_step(tmp_path):
    """Generation 2 resumed from step 40 and committed 50; a stalled generation-1 writer then got step 60 in
    (no newer checkpoint held that name). The resume takes 50: 60 belongs to a line training left behind."""
    for step, generation in ((30, 1), (40, 1), (50, 2), (60, 1)):
        install(save(tmp_path, step, generation), tmp_path / step_dir_name(step), generation)
    assert committed_steps(tmp_path) == [30, 40, 60, 50]
    legacy = tmp_path / "old"  # checkpoints written before generations were recorded count as generation 0
    install(save(legacy, 10, 1), legacy / step_dir_name(10), 1)
    (legacy / step_dir_name(10) / MARKER).write_text("{}")
    install(save(legacy, 20, 1), legacy / step_dir_name(20), 1)
    assert committed_steps(legacy) == [10, 20] and committed_by(legacy / step_dir_name(10)) == 0


@pytest.mark.parametrize("marker", ["not json", "[1, 2]", '{"generation": "9"}', '{"generation": true}',
                                    '{"generation": -3}', '{"generation": 1e30}', ""])  # fmt: skip
def test_a_marker_another_attempt_wrote_badly_claims_no_generation(tmp_path, marker):
    """A marker is read from the claim, written by any attempt: what it says about its generation counts only
    when it is a plain positive integer, so a mangled one can neither win the resume nor fence a writer."""
    target = tmp_path / step_dir_name(40)
    install(save(tmp_path, 40, 1), target, 1)
    (target / MARKER).write_text(marker)
    assert committed_by(target) == 0
    install(save(tmp_path, 40, 2), target, 2)  # any generation may replace it
    assert committed_by(target) == 2

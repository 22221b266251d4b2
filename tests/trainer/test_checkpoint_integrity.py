"""Checkpoints that survive torn writes, bit rot and disagreeing ranks, under real torchrun (2 agents x 2
processes, gloo, both strategies). One run per strategy writes six checkpoints; five of them are then damaged
in five different ways, newest first, and one resume must walk past all of them to the sixth."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import yaml

from sharded_api.contract import CORRUPT_INFIX, MARKER, TRAINER_STATE
from sharded_trainer.checkpoint.durability import checksum, rng_file
from sharded_trainer.checkpoint.manager import committed_steps, step_dir
from support.torchrun_jobs import SCRIPTS, run_job, run_many, write_config

pytestmark = pytest.mark.trainer


def shard(directory, strategy: str, rank: int):
    pattern = f"__{rank}_*.distcp" if strategy == "fsdp" else f"zero2/*zero_pp_rank_{rank}_*"
    return sorted(directory.glob(pattern))[0]


def ending_at(config, steps: int):
    """The config with training ending at `steps`, written next to it: a resume needs to reach only the next
    save to show that it trains on and commits again."""
    cfg = yaml.safe_load(config.read_text())
    cfg["steps"] = steps
    out = config.with_name(f"trainer-{steps}.yaml")
    out.write_text(yaml.safe_dump(cfg))
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Six checkpoints of each strategy, both runs in one launch."""
    tmp = tmp_path_factory.mktemp("six")
    configs = {s: write_config(tmp / s, **{"strategy.type": s, "steps": 60, "checkpoint.keepLast": 10})
               for s in ("fsdp", "zero2")}  # fmt: skip
    run_many(tmp, list(configs.values()))
    return configs


@pytest.fixture(scope="module", params=["fsdp", "zero2"])
def six(request, trained):
    config = trained[request.param]
    return request.param, config.parent, config


def test_the_marker_lists_every_file_with_its_size_and_checksum(six):
    _, tmp, _ = six
    d = step_dir(tmp / "ckpt", 60)
    files = json.loads((d / MARKER).read_text())["files"]
    on_disk = {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file() and p.name != MARKER}
    assert set(files) == on_disk and TRAINER_STATE in files and rng_file(3) in files
    assert all(list(checksum(d / name)) == entry for name, entry in files.items())


def test_a_resume_walks_past_every_damaged_checkpoint_to_the_newest_sound_one(six, tmp_path):
    strategy, tmp, config = six
    root = tmp / "ckpt"
    assert committed_steps(root) == [10, 20, 30, 40, 50, 60]
    damage = {
        60: "truncated shard",
        50: "flipped byte",
        40: "missing RNG file",
        30: "marker without files",
        20: "removal interrupted half way (marker left)",
    }
    truncated = shard(step_dir(root, 60), strategy, 1)
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    flipped = shard(step_dir(root, 50), strategy, 0)
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    (step_dir(root, 40) / rng_file(2)).unlink()
    for path in step_dir(root, 30).iterdir():
        if path.name != MARKER:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    for path in sorted(step_dir(root, 20).rglob("*.pt")) + sorted(step_dir(root, 20).glob("*.distcp")):
        path.unlink()
    # A removal interrupted the new way: marker gone first, files half deleted; swept at the next start.
    leftover = step_dir(root, 5)
    (leftover / "rng").mkdir(parents=True)
    (leftover / rng_file(0)).write_bytes(b"half")

    run = run_job(tmp, ending_at(config, 20), script=[str(SCRIPTS / "skewed_view.py")])
    assert run.returncodes == [0, 0], run.output[-4000:]
    assert run.event("resumed")["step"] == 10
    # Rank 0 chose for all: ranks shown an older "newest" still loaded the same step.
    assert sorted(re.findall(r"LOADED rank (\d) step (\d+)", run.output)) == [(str(r), "10") for r in range(4)]
    set_aside = [m for m in run.metrics if m.get("event") == "set_aside"]
    assert [m["step"] for m in set_aside] == list(damage), set_aside
    reasons = {m["step"]: m["reason"] for m in set_aside}
    assert "bytes" in reasons[60] and "checksum" in reasons[50] and "rng/rank-2.pt is missing" in reasons[40]
    assert "unreadable" in reasons[30] and "missing" in reasons[20], reasons
    for step in damage:  # kept for inspection, out of the way
        assert [p.name for p in root.glob(f"{step_dir(root, step).name}{CORRUPT_INFIX}*")], step
    assert not leftover.exists()
    assert committed_steps(root) == [10, 20]  # trained again from 10, its save committed


def test_a_checkpoint_from_before_checksums_is_checked_by_loading_it(six, tmp_path):
    """A marker without a file list (an older release wrote it) cannot be verified: a load that fails sets
    it aside all the same. The damaged file is one every rank reads, as a real torn metadata file would be."""
    strategy, tmp, config = six
    root = tmp / "ckpt"
    *_, before, last = committed_steps(root)
    newest = step_dir(root, last)
    marker = json.loads((newest / MARKER).read_text())
    del marker["files"]
    (newest / MARKER).write_text(json.dumps(marker))
    read_by_all = newest / (".metadata" if strategy == "fsdp" else "zero2/mp_rank_00_model_states.pt")
    read_by_all.write_bytes(read_by_all.read_bytes()[:100])

    run = run_job(tmp, ending_at(config, last))
    assert run.returncodes == [0, 0], run.output[-4000:]
    [aside] = [m for m in run.metrics if m.get("event") == "set_aside"]
    assert aside["step"] == last and "loading failed" in aside["reason"], aside
    assert run.event("resumed")["step"] == before

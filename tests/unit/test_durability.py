"""Verifying a checkpoint against its marker, fed a hostile marker: a file on a shared claim."""

from __future__ import annotations

from sharded_trainer.checkpoint.durability import checksum, verify


def test_a_hostile_marker_makes_the_checkpoint_unverifiable_never_a_crash_or_a_read_elsewhere(tmp_path):
    (tmp_path / "shard").write_bytes(b"data")
    good = {"shard": list(checksum(tmp_path / "shard"))}
    assert verify(tmp_path, good, good) == []
    hostile = {"../../etc/passwd": [1, 2], "/etc/hostname": [1, 2], "shard": "x", "gone": [None, {}],
               "short": [4]}  # fmt: skip
    problems = verify(tmp_path, hostile, hostile)
    assert len(problems) == 5 and sum("not a path inside" in p for p in problems) == 2
    assert sum("malformed entry" in p for p in problems) == 3

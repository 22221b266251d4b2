"""The locked dependency set (requirements/, `make lock`): what the tests run on is what the images ship."""

from __future__ import annotations

import shutil
import sys
from importlib import metadata
from pathlib import Path

import pytest

import lock

LOCKED = lock.pins(lock.REQS / "lock.txt")


def test_the_lock_was_resolved_from_the_current_pyproject():
    assert lock.check() == [], "run `make lock`"


def test_editing_a_dependency_without_make_lock_is_caught(tmp_path):
    shutil.copytree(lock.REQS, tmp_path / "requirements")
    text = (lock.ROOT / "pyproject.toml").read_text().replace('"pyyaml>=6"', '"pyyaml>=6.0.2"')
    (tmp_path / "pyproject.toml").write_text(text)
    assert lock.check(tmp_path) == ["requirements/lock.txt", "requirements/operator.txt", "requirements/trainer.txt"]


def test_the_installed_packages_are_exactly_the_locked_ones():
    """Fails when anything is installed beside the lock, missing from it, or at another version."""
    # Only the virtualenv's site-packages: once imported, setuptools appends its own _vendor folder to
    # sys.path, whose vendored dist-infos (wheel, packaging, autocommand...) are not installed packages.
    paths = [entry for entry in sys.path if not Path(entry).match("setuptools/_vendor")]
    dists = metadata.distributions(path=paths)
    installed = {lock.normalize(d.metadata["Name"]): d.version for d in dists}
    installed.pop("sharded-training")  # this project, editable
    installed.pop("pip")  # the virtualenv's own installer (ensurepip), never imported by the project
    assert installed == LOCKED


@pytest.mark.parametrize("subset", ["operator.txt", "trainer.txt"])
def test_each_image_subset_pins_the_locked_versions(subset):
    pinned = lock.pins(lock.REQS / subset)
    assert pinned and {name: LOCKED.get(name) for name in pinned} == pinned


def test_torch_and_deepspeed_are_the_versions_the_gpu_benchmarks_ran():
    assert LOCKED["torch"] == "2.11.0" and LOCKED["deepspeed"] == "0.19.8"
    trainer = lock.pins(lock.REQS / "trainer.txt")
    assert trainer["torch"] == "2.11.0" and trainer["deepspeed"] == "0.19.8"

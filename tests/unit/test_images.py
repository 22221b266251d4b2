"""The images are reused only when nothing they are built from changed: the digest of their inputs."""

from __future__ import annotations

import shutil

import pytest

from images import CONTEXT, ROOT, inputs_digest


def test_the_digested_context_is_what_dockerignore_lets_into_the_build():
    allowed = [line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")]  # fmt: skip
    assert sorted(allowed) == sorted(CONTEXT)


@pytest.fixture
def tree(tmp_path):
    """A copy of the files an image is built from, and one file the build never sees."""
    for entry in CONTEXT:
        source = ROOT / entry
        if source.is_file():
            shutil.copy(source, tmp_path / entry)
        else:
            shutil.copytree(source, tmp_path / entry, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "operator" / "Dockerfile").write_text((ROOT / "operator" / "Dockerfile").read_text())
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("x = 1\n")
    return tmp_path


def test_any_change_to_a_built_file_its_name_the_dockerfile_or_the_base_changes_the_digest(tree):
    def digest(base: str = "base:1") -> str:
        return inputs_digest("operator/Dockerfile", base, root=tree)

    first = digest()
    assert digest() == first
    module = tree / "operator" / "sharded_operator" / "run" / "reconcile.py"
    module.write_text(module.read_text() + "\n# changed\n")
    changed = digest()
    assert changed != first
    module.rename(module.with_name("reconcile2.py"))
    assert digest() not in (first, changed)
    module.with_name("reconcile2.py").rename(module)
    assert digest() == changed
    (tree / "requirements" / "operator.txt").write_text("torch==0\n")
    assert digest() != changed
    changed = digest()
    (tree / "operator" / "Dockerfile").write_text("FROM scratch\n")
    assert digest() != changed
    changed = digest()
    assert digest("base:2") != changed


def test_bytecode_and_files_outside_the_context_leave_the_digest_alone(tree):
    first = inputs_digest("operator/Dockerfile", "base:1", root=tree)
    cache = tree / "trainer" / "sharded_trainer" / "__pycache__"
    cache.mkdir(exist_ok=True)
    (cache / "x.cpython-311.pyc").write_bytes(b"\0")
    (tree / "tests" / "test_x.py").write_text("x = 2\n")
    assert inputs_digest("operator/Dockerfile", "base:1", root=tree) == first

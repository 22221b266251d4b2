"""The front door stays true to the tree: the README's size and module map, every relative link of the docs,
the index of bench/results, the size of every module (the defaults the docs state: test_documented_defaults)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
# Folders whose every module the map must name (bench/ holds scripts, named by docs/benchmarks.md).
PACKAGES = ["api", "operator", "trainer", "hack", "tests/support"]


def test_the_readme_is_a_front_door_not_a_manual():
    assert len(README.read_text()) < 8000, "move detail into docs/ and link it from 'Where to read next'"


def module_map() -> dict[Path, set[str]]:
    """{folder: the words of its lines} from the README's module map (a line per folder, indented under its
    parent; continuation lines have no folder of their own)."""
    text = README.read_text()
    block = text[text.index("## Module map") :].split("```")[1]
    folders: dict[Path, set[str]] = {}
    parents: list[tuple[int, Path]] = []
    current: Path | None = None
    for line in block.strip("\n").splitlines():
        indent = len(line) - len(line.lstrip())
        first = line.split()[0]
        if first.endswith("/") and indent < 20:  # a folder (a continuation line is indented past the paths)
            parents = [(i, p) for i, p in parents if i < indent]
            base = parents[-1][1] if parents else Path()
            current = base / first
            parents.append((indent, current))
            folders[current] = set()
            line = line.replace(first, "", 1)
        assert current is not None, line
        folders[current] |= set(re.findall(r"[a-z_0-9]+", line))
    return folders


def test_the_module_map_names_every_folder_and_module_of_the_tree():
    folders = module_map()
    missing = [str(f) for f in folders if not (ROOT / f).is_dir()]
    assert not missing, f"the module map names folders that do not exist: {missing}"
    unnamed = []
    for top in PACKAGES:
        for init in sorted((ROOT / top).rglob("__init__.py")):
            package = init.parent.relative_to(ROOT)
            if package.parts[-1] in ("sharded_operator", "sharded_trainer", "sharded_api") or package in folders:
                continue
            unnamed.append(f"folder {package}/")
    for folder, words in folders.items():
        modules = {p.stem for p in (ROOT / folder).glob("*.py") if p.stem not in ("__init__", "__main__")}
        if folder.parts[0] in ("bench", "tests") and folder.parts[-1] != "support":
            continue
        unnamed += [f"{folder}/{m}.py" for m in sorted(modules - words)]
    assert not unnamed, "add these to the README's module map (one word each, on their folder's line):\n" + "\n".join(
        unnamed
    )


def test_the_map_check_finds_a_module_left_out(monkeypatch, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("## Module map\n\n```\nhack/     tools: demo\n```\n")
    monkeypatch.setattr(__import__(__name__), "README", readme)
    assert module_map() == {Path("hack/"): {"tools", "demo"}}


LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def test_every_relative_link_of_the_docs_points_at_a_file():
    broken = []
    for doc in DOCS:
        for target, _ in LINK.findall(doc.read_text()):
            if not re.match(r"^[a-z]+:", target) and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, "\n".join(broken)


def test_bench_results_holds_a_folder_per_benchmark_and_its_index_lists_every_file():
    results = ROOT / "bench" / "results"
    index = (results / "README.md").read_text()
    loose = [p.name for p in results.iterdir() if p.is_file() and p.name != "README.md"]
    assert not loose, f"put these in their benchmark's folder: {loose}"
    listed = set(re.findall(r"^- `([^`]+)`: ", index, re.M))
    sections = re.findall(r"^## ([\w-]+)/$", index, re.M)
    on_disk = {
        p.relative_to(results / folder).as_posix()
        for folder in sections
        for p in (results / folder).rglob("*")
        if p.is_file()
    }
    assert sorted(p.name for p in results.iterdir() if p.is_dir()) == sorted(sections)
    assert on_disk == listed, f"unlisted: {sorted(on_disk - listed)}; gone: {sorted(listed - on_disk)}"


def test_no_module_outside_the_tests_is_over_400_lines():
    """The house's rule: a module does one thing; one that grows past 400 lines is split by concern."""
    long = [
        f"{p.relative_to(ROOT)}: {n}"
        for top in ("api", "operator", "trainer", "hack", "bench")
        for p in sorted((ROOT / top).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > 400
    ]
    assert not long, long

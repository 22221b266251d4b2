"""The front door stays true to the tree: the README's size and module map, every relative link of the docs,
the index of bench/results, and every default the docs state equal to the code's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from sharded_operator.api.models import ShardedTrainingJobSpec

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


# --- defaults the docs state ----------------------------------------------------------------------------

# `name` (default `V`, `name` (default V), `name` (60 s): a number in brackets), `name`, default `V`
DEFAULT = re.compile(
    r"`(?P<a>[A-Za-z][\w.]*)`,? \(default `(?P<av>[^`]+)`"
    r"|`(?P<d>[A-Za-z][\w.]*)`,? \(default (?P<dv>[\w.-]+)\)"
    r"|`(?P<b>[A-Za-z][\w.]*)` \((?P<bv>\d+)(?: s)?\)"
    r"|`(?P<c>[A-Za-z][\w.]*)`, default `(?P<cv>[^`]+)`"
)


def documented_defaults() -> list[tuple[str, str, str]]:
    found = []
    for doc in DOCS:
        if doc.name == "benchmarks-history.md":  # a journal of what was measured then
            continue
        for m in DEFAULT.finditer(doc.read_text()):
            name, value = next((m[k], m[k + "v"]) for k in "adbc" if m[k])
            if re.fullmatch(r"\[?[\w\-.,: ]+\]?", value):
                found.append((doc.name, name, value))
    return found


def _field(model: type[BaseModel], path: list[str]) -> Any:
    """The default of the field at `path` (camelCase) in `model`, or KeyError."""
    by_alias = {(f.alias or n): (n, f) for n, f in model.model_fields.items()}
    _, f = by_alias[path[0]]
    if len(path) == 1:
        return f.get_default(call_default_factory=True)
    sub = f.annotation
    sub = next(a for a in getattr(sub, "__args__", (sub,)) if isinstance(a, type) and issubclass(a, BaseModel))
    return _field(sub, path[1:])


def code_default(name: str) -> Any:
    """What the code says `name` defaults to: a field of the job spec (by path, or a name unique among its
    parts), a chart value, or an image's build argument."""
    if name.isupper():
        dockerfile = (ROOT / "operator" / "Dockerfile").read_text()
        return re.search(rf"^ARG {name}=(\S+)", dockerfile, re.M).group(1)
    try:
        return _field(ShardedTrainingJobSpec, name.split("."))
    except (KeyError, StopIteration):
        pass
    for part in ("failurePolicy", "runPolicy", "rendezvous", "checkpoint", "elastic", "network"):
        try:
            return _field(ShardedTrainingJobSpec, [part, *name.split(".")])
        except (KeyError, StopIteration):
            continue
    values: Any = yaml.safe_load((ROOT / "charts" / "sharded-training-operator" / "values.yaml").read_text())
    for key in name.split("."):
        values = values[key]
    return values


def test_every_default_the_docs_state_is_the_codes():
    found = documented_defaults()
    assert len(found) >= 8, found  # the failure policy's, the rendezvous', the chart's: the scan still finds them
    wrong = []
    for doc, name, value in found:
        try:
            actual = code_default(name)
        except (KeyError, TypeError, AttributeError):
            wrong.append(f"{doc}: `{name}` names no field, chart value or build argument")
            continue
        said = yaml.safe_load(value)
        if isinstance(actual, list) and not isinstance(said, list):
            said = [said]
        if said != actual:
            wrong.append(f"{doc}: `{name}` is documented as {value!r}; the code says {actual!r}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    "line,expected",
    [
        ("`failurePolicy.nodeLostSeconds` (default 60)", ("failurePolicy.nodeLostSeconds", "60")),
        ("`failurePolicy.permanentExitCodes`, default `[2, 4]`: x", ("failurePolicy.permanentExitCodes", "[2, 4]")),
        ("`progress.writeSeconds` (10 s)", ("progress.writeSeconds", "10")),
    ],
)
def test_the_default_scan_reads_each_way_the_docs_write_one(tmp_path, monkeypatch, line, expected):
    doc = tmp_path / "x.md"
    doc.write_text(line)
    monkeypatch.setattr(__import__(__name__), "DOCS", [doc])
    assert [d[1:] for d in documented_defaults()] == [expected]


def test_no_module_outside_the_tests_is_over_400_lines():
    """The house's rule: a module does one thing; one that grows past 400 lines is split by concern."""
    long = [
        f"{p.relative_to(ROOT)}: {n}"
        for top in ("api", "operator", "trainer", "hack", "bench")
        for p in sorted((ROOT / top).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > 400
    ]
    assert not long, long

"""Where the suite's time goes, and a floor under what it proves.

A pytest plugin loaded by tests/conftest.py. At the end of every run it prints (and writes to
`--suite-times FILE`) a table of wall time per tier (the folder under tests/), per module, and per
expensive fixture set-up (control-plane starts, operator starts, torchrun launches, image builds), so
anyone sees where the minutes are without reading 1,000 `--durations` lines. Next to each tier's and
module's wall time stands the CPU time its tests cost the machine: the suite runs its lanes side by side
on few cores, so a test's wall time says more about its neighbours than about itself, while its CPU
time is what a cut would give back.

With `--test-floor FILE` (passed by `make test`) it also refuses a collection that proves less than the
recorded floor: the number of collected tests and of test functions per tier may not fall below the
counts in FILE, so the suite never gets faster by dropping tests. `--test-floor-update` rewrites FILE
from the current collection (only upwards: a floor never goes down by itself).
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections import defaultdict
from pathlib import Path

import pytest
from suite import CPU_CGROUP_ENV

TESTS = Path(__file__).resolve().parent.parent

# Set-up times below this are noise (a tmp_path, a namespace); the table names only what costs.
_FIXTURE_FLOOR_S = 2.0


def _ticks(stat: str) -> int:
    """utime + stime + cutime + cstime of one /proc/PID/stat line (fields 14-17, after the command)."""
    fields = stat.rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15])


# hack/suite.py puts each lane in a cpuacct cgroup of its own (a hierarchy apart from the scheduler's, so
# nothing is throttled) and names it in CPU_CGROUP_ENV: the cgroup counts every process the lane started,
# orphans too.


def cpu_seconds() -> float:
    """CPU seconds this lane has cost: its cgroup's usage when it has one, else its process tree's."""
    group = os.environ.get(CPU_CGROUP_ENV)
    if group:
        try:
            return int(Path(group, "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            pass
    return tree_cpu_seconds()


def tree_cpu_seconds(root: int | None = None) -> float:
    """CPU seconds spent so far by this process and every process under it: the reaped ones through
    their parents' children totals (this process's, and the live descendants' cutime/cstime), the live
    ones from /proc. A descendant orphaned before it ends (re-parented away) is lost, as is what runs in
    containers under dockerd: torchrun's workers are, once their agent's fork server outlives the agent, hence
    the cgroup of `cpu_seconds` where there is one."""
    root = os.getpid() if root is None else root
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:  # gone between the listing and the read
            continue
        pid = int(entry.name)
        parent[pid] = int(stat.rsplit(")", 1)[1].split()[1])
        ticks[pid] = _ticks(stat)
    below, frontier = set(), [root]
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in below:
                below.add(child)
                frontier.append(child)
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    hz = os.sysconf("SC_CLK_TCK")
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime + sum(ticks[p] for p in below) / hz


def _tier(nodeid: str) -> str:
    """`tests/trainer/test_x.py::test_y` -> `trainer`, the folder a test lives in."""
    parts = nodeid.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]


def pytest_addoption(parser):
    group = parser.getgroup("suite clock")
    group.addoption("--suite-times", metavar="FILE", help="write the per-tier and per-fixture time table to FILE")
    group.addoption("--test-floor", metavar="FILE",
                    help="fail when fewer tests per tier are collected than FILE records")  # fmt: skip
    group.addoption("--test-floor-update", action="store_true",
                    help="raise the floor in --test-floor FILE to this collection")  # fmt: skip


class SuiteClock:
    def __init__(self, config):
        self.config = config
        self.started = time.monotonic()
        self.by_tier: dict[str, float] = defaultdict(float)
        self.by_module: dict[str, float] = defaultdict(float)
        self.cpu_by_tier: dict[str, float] = defaultdict(float)
        self.cpu_by_module: dict[str, float] = defaultdict(float)
        self.cpu_by_test: dict[str, float] = {}
        self.cpu_started = cpu_seconds()
        self.tests_by_tier: dict[str, int] = defaultdict(int)
        self.fixtures: dict[str, list[float]] = defaultdict(list)
        self.outcomes: dict[str, int] = defaultdict(int)

    # -- collection: the floor --------------------------------------------------------------------------
    def pytest_collection_finish(self, session):
        path = self.config.getoption("--test-floor")
        if not path:
            return
        counts = collected_counts(session.items)
        floor_file = Path(path)
        floor = json.loads(floor_file.read_text()) if floor_file.exists() else {}
        if self.config.getoption("--test-floor-update"):
            merged = {
                tier: {k: max(v, floor.get(tier, {}).get(k, 0)) for k, v in c.items()} for tier, c in counts.items()
            }
            floor_file.write_text(json.dumps(dict(sorted(merged.items())), indent=2) + "\n")
            return
        short = floor_shortfalls(floor, counts)
        if short:
            raise pytest.UsageError(
                "the suite proves less than its recorded floor ("
                + path
                + "):\n  "
                + "\n  ".join(short)
                + "\nspeed must not come from dropping tests; restore them, or lower the floor in a reviewed commit"
            )

    # -- timing -----------------------------------------------------------------------------------------
    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        t0 = time.monotonic()
        yield
        took = time.monotonic() - t0
        if took >= _FIXTURE_FLOOR_S:
            param = getattr(request, "param", None)
            name = fixturedef.argname + (f"[{param}]" if isinstance(param, str | int) else "")
            self.fixtures[name].append(took)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        # Set-up, call and tear-down together: a session fixture's start is charged to its first test.
        before = cpu_seconds()
        yield
        spent = cpu_seconds() - before
        self.cpu_by_tier[_tier(item.nodeid)] += spent
        self.cpu_by_module[item.nodeid.split("::")[0]] += spent
        self.cpu_by_test[item.nodeid] = spent

    def pytest_runtest_logreport(self, report):
        tier = _tier(report.nodeid)
        self.by_tier[tier] += report.duration
        self.by_module[report.nodeid.split("::")[0]] += report.duration
        if report.when == "call" or (report.when == "setup" and not report.passed):
            self.tests_by_tier[tier] += 1
            self.outcomes[report.outcome] += 1

    def table(self) -> str:
        wall = time.monotonic() - self.started
        cpu = cpu_seconds() - self.cpu_started
        lines = [f"suite wall time {wall / 60:.1f} min, {cpu:.0f} CPU-s of this lane's processes; "
                 "inside tests (set-up, call, tear-down) by tier, wall and CPU:"]  # fmt: skip
        for tier, secs in sorted(self.by_tier.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {tier:<14} {secs / 60:6.1f} min {self.cpu_by_tier[tier]:7.0f} CPU-s"
                         f"  {self.tests_by_tier[tier]:5d} tests")  # fmt: skip
        lines.append("slowest modules (wall, CPU):")
        for mod, secs in sorted(self.by_module.items(), key=lambda kv: -kv[1])[:15]:
            lines.append(f"  {secs / 60:6.1f} min {self.cpu_by_module[mod]:7.0f} CPU-s  {mod}")
        lines.append("costliest tests in CPU:")
        for test, secs in sorted(self.cpu_by_test.items(), key=lambda kv: -kv[1])[:20]:
            lines.append(f"  {secs:7.1f} CPU-s  {test}")
        lines.append(f"fixture set-ups over {_FIXTURE_FLOOR_S:.0f} s (count x mean = total):")
        for name, times in sorted(self.fixtures.items(), key=lambda kv: -sum(kv[1]))[:25]:
            lines.append(f"  {len(times):3d} x {sum(times) / len(times):6.1f} s = {sum(times) / 60:5.1f} min  {name}")
        return "\n".join(lines) + "\n"

    def pytest_terminal_summary(self, terminalreporter):
        if not self.by_tier:
            return
        text = self.table()
        terminalreporter.write_sep("=", "suite time table")
        terminalreporter.write(text)
        path = self.config.getoption("--suite-times")
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)


def collected_counts(items) -> dict[str, dict[str, int]]:
    """Per tier: how many tests (parametrized cases count one each) and how many test functions."""
    tests: dict[str, int] = defaultdict(int)
    functions: dict[str, set[str]] = defaultdict(set)
    for item in items:
        tier = _tier(item.nodeid)
        tests[tier] += 1
        functions[tier].add(item.nodeid.split("[")[0])
    return {tier: {"tests": tests[tier], "functions": len(functions[tier])} for tier in tests}


def floor_shortfalls(floor: dict, counts: dict) -> list[str]:
    """Every (tier, kind) whose collected count is below the floor's, as a readable line."""
    short = []
    for tier, want in sorted(floor.items()):
        have = counts.get(tier, {})
        for kind, n in sorted(want.items()):
            if have.get(kind, 0) < n:
                short.append(f"{tier}: {have.get(kind, 0)} {kind} collected, floor {n}")
    return short


def pytest_configure(config):
    config.pluginmanager.register(SuiteClock(config), "suite-clock")

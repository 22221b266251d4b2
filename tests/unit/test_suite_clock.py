"""The suite's floor: fewer tests or test functions in a tier than recorded is refused."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

from support.suite_clock import CPU_CGROUP_ENV, collected_counts, cpu_seconds, floor_shortfalls, tree_cpu_seconds


def _items(*nodeids):
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_parametrized_cases_count_as_tests_and_once_as_a_function():
    counts = collected_counts(
        _items(
            "tests/unit/test_a.py::test_x[1]",
            "tests/unit/test_a.py::test_x[2]",
            "tests/unit/test_a.py::test_y",
            "tests/trainer/test_b.py::test_z[fsdp]",
        )
    )
    assert counts == {"unit": {"tests": 3, "functions": 2}, "trainer": {"tests": 1, "functions": 1}}


def test_a_tier_below_its_floor_is_named_and_one_at_or_above_passes():
    floor = {"unit": {"tests": 3, "functions": 2}, "e2e": {"tests": 1, "functions": 1}}
    counts = {"unit": {"tests": 3, "functions": 1}}
    assert floor_shortfalls(floor, counts) == [
        "e2e: 0 functions collected, floor 1",
        "e2e: 0 tests collected, floor 1",
        "unit: 1 functions collected, floor 2",
    ]
    assert floor_shortfalls(floor, {"unit": {"tests": 9, "functions": 9}, "e2e": {"tests": 1, "functions": 1}}) == []


def test_the_suite_names_each_failed_test_with_the_first_line_of_why_and_the_tail_of_its_report(tmp_path):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("suite", Path(__file__).parents[2] / "hack" / "suite.py")
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="1">'
        '<testcase classname="tests.soak.test_soak" name="test_soak"><failure message="assert 1 == 2&#10;more">'
        + "&#10;".join(f"tb{i}" for i in range(suite.REPORT_LINES + 5))
        + '</failure></testcase><testcase classname="tests.e2e.t" name="test_e"><error message="">boom&#10;x</error>'
        '</testcase><testcase classname="tests.unit.t" name="test_ok"/></testsuite></testsuites>'
    )
    soak, e2e = suite.failures(junit)
    assert soak[0] == "tests.soak.test_soak::test_soak [failure] assert 1 == 2"
    # The report's end (where the assertion and the job's logs are), not its start.
    assert soak[1].splitlines() == [f"tb{i}" for i in range(5, suite.REPORT_LINES + 5)]
    assert e2e == ("tests.e2e.t::test_e [error] boom", "boom\nx")
    assert suite.totals(junit) == {"tests": 3, "failures": 1, "errors": 1, "skipped": 0, "passed": 1}


def test_cpu_of_the_process_tree_counts_reaped_grandchildren_and_live_childrens_reaped_ones(tmp_path):
    # A grandchild that burns CPU and is reaped by its own parent, once with that parent reaped too and once
    # with it still alive: both must land in the tree's total, or the time table would miss torchrun's workers.
    burn = tmp_path / "burn.py"
    burn.write_text("import time\nwhile time.process_time() < 0.3:\n    pass\n")
    spawn = f"import subprocess, sys, time; subprocess.run([sys.executable, {str(burn)!r}]); time.sleep(%s)"
    before = tree_cpu_seconds()
    subprocess.run([sys.executable, "-c", spawn % 0], check=True)
    reaped = tree_cpu_seconds()
    live = subprocess.Popen([sys.executable, "-c", spawn % 30])
    try:
        deadline = time.monotonic() + 20
        while tree_cpu_seconds() - reaped < 0.3 and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = tree_cpu_seconds()
        assert live.poll() is None
    finally:
        live.kill()
        live.wait()
    assert reaped - before >= 0.3
    assert alive - reaped >= 0.3


def test_a_lanes_cgroup_is_read_when_named_and_the_process_tree_when_it_cannot_be(tmp_path, monkeypatch):
    (tmp_path / "cpuacct.usage").write_text("12500000000\n")  # nanoseconds, as cgroup v1's cpuacct writes them
    monkeypatch.setenv(CPU_CGROUP_ENV, str(tmp_path))
    assert cpu_seconds() == 12.5
    for unreadable in ("garbage", None):  # then this process's own tree
        if unreadable:
            (tmp_path / "cpuacct.usage").write_text(unreadable)
        else:
            monkeypatch.setenv(CPU_CGROUP_ENV, str(tmp_path / "gone"))
        before = tree_cpu_seconds()
        assert before <= cpu_seconds() <= tree_cpu_seconds()

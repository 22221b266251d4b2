"""The whole test suite in three lanes side by side: what `make test` runs.

The tiers differ in what they wait on (measured on a 2-core machine, the CPU's busy share while each
ran alone): the trainer tier keeps both cores busy with torchrun's processes (16.5 minutes alone); the
e2e tier trains real jobs through its own control plane and node agent and leaves a quarter to a half
of the machine idle while pods start, rendezvous and checkpoint (12 minutes); the integration tier and
the soak wait on the API server and KWOK with the machine 85-95% idle (9 minutes). In two lanes (trainer
and unit; e2e, integration and soak) the second lane was the longer (30.5 of 30.7 minutes): the
integration tier and the soak, which mostly wait, waited behind the e2e tier. In three (trainer and
unit; e2e; integration and soak) the first was (27.1 minutes, the third done at 14). So the fine-tuning
module of the trainer tier (6 minutes alone, with fixtures of its own: a claim of models and one launch
for its matrix) ran after the integration tier and the soak: each lane then took 24-26 minutes in clean
clones, the two cores 1.9 busy on average (about 2,950 CPU-seconds in 25 minutes, two thirds of them
torchrun's processes), so a shorter suite needs less work, not more lanes. Once the option runs shared
two launches, the first lane took 21.1 minutes and the third 24.5 (13.2 of them fine-tuning): the trainer
modules that share the 2x2 reference runs (12 minutes) now follow the integration tier and the soak, and
the fine-tuning module runs with the other trainer modules. The realnode tier, once it trained whole jobs
from the trainer image (whose import into two nodes' containerd takes minutes after each new build), went
from the third lane (20.5 of 20.7 minutes) to the head of the first (14.4). Each lane is its own pytest
process (its own control plane, its own temporary directory): the waits of one lane are the others' CPU
time.

Nothing is dropped for speed: the whole suite is collected first and checked against the floor of
tests/floor.json, and every collected test must have run in one of the lanes. Each lane's output is
streamed with its name in front; at the end the per-tier time tables of the lanes are written to
build/suite-times.txt and the totals are printed as one closing line.

    python hack/suite.py [pytest args...]     # extra args go to every lane (e.g. -x, -k)
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build"
FLOOR = ROOT / "tests" / "floor.json"
# The trainer modules that share the session's 2x2 reference runs (world4_run) stay in one lane.
SHARED_RUNS = ["tests/trainer/test_torchrun.py", "tests/trainer/test_options.py", "tests/trainer/test_reshard.py"]
LANES = {
    "lane1": ["tests/realnode", "tests/trainer", "tests/unit", *(f"--ignore={m}" for m in SHARED_RUNS)],
    "lane2": ["tests/e2e"],
    "lane3": ["tests/integration", "tests/soak", *SHARED_RUNS],
}
# What the lanes run together: the whole suite, collected once for the floor.
# How much of a failed test's report the summary repeats (the end of the traceback and the job's log tails).
REPORT_LINES = 120
TIERS = ["tests/unit", "tests/trainer", "tests/integration", "tests/realnode", "tests/e2e", "tests/soak"]


def _pytest(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]


def collected() -> int:
    """Collect the whole suite once, refusing it below the floor; the number of tests."""
    out = subprocess.run(_pytest("--collect-only", "-q", "--test-floor", str(FLOOR), *TIERS),
                         cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    if out.returncode != 0:
        sys.stdout.write(out.stdout[-5000:] + out.stderr[-5000:])
        raise SystemExit(out.returncode or 1)
    last = [line for line in out.stdout.splitlines() if " collected" in line]
    return int(last[-1].split()[0]) if last else 0


def _stream(name: str, proc: subprocess.Popen, log: Path) -> None:
    with open(log, "w") as f:
        for line in proc.stdout:
            f.write(line)
            f.flush()
            sys.stdout.write(f"[{name}] {line}")
            sys.stdout.flush()


def totals(junit: Path) -> dict[str, int]:
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    n["passed"] = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    return n


def failures(junit: Path) -> list[tuple[str, str]]:
    """Each failed or erroring test of a lane's results: its one line (the test and the first line of why,
    printed last, so the tail of a long run's output still names them) and the tail of its report (the
    assertion with what the test printed of the job's logs), printed before: a clean clone's lane logs go
    with it, and a failure seen once must be readable from the output alone."""
    out = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        for bad in (*case.findall("failure"), *case.findall("error")):
            why = (bad.get("message") or bad.text or "").strip().splitlines()
            line = f"{case.get('classname')}::{case.get('name')} [{bad.tag}] {why[0][:300] if why else ''}"
            out.append((line, "\n".join((bad.text or "").strip().splitlines()[-REPORT_LINES:])))
    return out


def ran(junit: Path) -> list[str]:
    """Every test a lane's results name (a test two lanes ran would be counted twice)."""
    return [f"{c.get('classname')}::{c.get('name')}" for c in ET.parse(junit).getroot().iter("testcase")]


def busy_cpu_seconds() -> float:
    """The whole machine's busy CPU time so far (every core's, from /proc/stat): with the lanes side by
    side, the suite's length is this divided by the cores, whatever the lanes' order."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]
    # user nice system idle iowait irq softirq steal: all but idle and iowait are busy
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


CPUACCT = Path("/sys/fs/cgroup/cpuacct")
# Names a lane's cpuacct cgroup to its pytest (tests/support/suite_clock.py reads it).
CPU_CGROUP_ENV = "SHARDED_SUITE_CPU_CGROUP"


def cpu_cgroup(name: str) -> Path | None:
    """A cpuacct cgroup for one lane (cgroup v1's accounting-only hierarchy: it throttles nothing), so the time
    table charges each test every process its lane started, orphans included; None where there is no such
    hierarchy or no right to make one (the table then counts the lane's process tree)."""
    group = CPUACCT / f"sharded-suite-{name}-{os.getpid()}"
    try:
        group.mkdir()
    except OSError:
        return None
    return group


def _join(group: Path | None):
    """preexec_fn: the lane's pytest enters its cgroup before it starts anything. A lane that cannot enter it
    still runs (its table then counts its process tree): accounting never stops the suite."""
    if group is None:
        return None

    def enter() -> None:
        with contextlib.suppress(OSError):
            (group / "cgroup.procs").write_text(str(os.getpid()))

    return enter


def main(extra: list[str]) -> int:
    BUILD.mkdir(exist_ok=True)
    started, busy = time.monotonic(), busy_cpu_seconds()
    want = collected()
    print(f"[suite] {want} tests collected (at or above tests/floor.json); {len(LANES)} lanes: "
          + "; ".join(f"{n}: {' '.join(p)}" for n, p in LANES.items()), flush=True)  # fmt: skip
    procs, threads, groups = {}, [], {}
    for name, paths in LANES.items():
        # A lane that dies before writing its results must not be read as the last run's.
        for stale in (BUILD / f"junit-{name}.xml", BUILD / f"suite-times-{name}.txt"):
            stale.unlink(missing_ok=True)
        # A short temporary root of its own (pytest empties it first): tests bind Unix sockets under it.
        args = _pytest("-v", "--durations=25", f"--basetemp={Path(tempfile.gettempdir()) / ('sharded-' + name)}",
                       f"--junitxml={BUILD / ('junit-' + name + '.xml')}",
                       f"--suite-times={BUILD / ('suite-times-' + name + '.txt')}", *paths, *extra)  # fmt: skip
        group = groups[name] = cpu_cgroup(name)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **({CPU_CGROUP_ENV: str(group)} if group else {})}
        procs[name] = p = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                           text=True, env=env, preexec_fn=_join(group))  # fmt: skip
        threads.append(threading.Thread(target=_stream, args=(name, p, BUILD / f"{name}.log"), daemon=True))
        threads[-1].start()
    codes = {name: p.wait() for name, p in procs.items()}
    for group in filter(None, groups.values()):
        # A process the lane left behind keeps its group; it goes with the machine.
        with contextlib.suppress(OSError):
            group.rmdir()
    for t in threads:
        t.join()
    wall, busy = time.monotonic() - started, busy_cpu_seconds() - busy
    tables = [f"== {name}: {' '.join(LANES[name])}\n" + (BUILD / f"suite-times-{name}.txt").read_text()
              for name in LANES if (BUILD / f"suite-times-{name}.txt").exists()]  # fmt: skip
    head = (
        f"suite wall time {wall / 60:.1f} min in {len(LANES)} lanes; the machine busy {busy:.0f} CPU-s "
        f"of {wall * (os.cpu_count() or 1):.0f} ({os.cpu_count()} cores)\n"
    )
    (BUILD / "suite-times.txt").write_text(head + "\n".join(tables))
    print("\n[suite] time table (build/suite-times.txt):\n" + (BUILD / "suite-times.txt").read_text())
    n = {"passed": 0, "failures": 0, "errors": 0, "skipped": 0, "tests": 0}
    bad, names = [], []
    for name in LANES:
        junit = BUILD / f"junit-{name}.xml"
        if junit.exists():
            for k, v in totals(junit).items():
                n[k] += v
            bad += [(f"[{name}] {line}", report) for line, report in failures(junit)]
            names += ran(junit)
    twice = sorted(t for t, k in Counter(names).items() if k > 1)
    for line, report in bad:
        print(f"\n[suite] ---- {line}\n{report}")
    if bad:
        print("[suite] failed (the lane's log in build/ has the whole report):\n  " + "\n  ".join(b[0] for b in bad))
    failed = n["failures"] + n["errors"]
    # With -k or -x a lane runs less on purpose (or nothing: pytest's exit 5 is then no failure).
    ran_all = (n["tests"] >= want or bool(extra)) and not twice
    codes = {name: 0 if c == 5 and extra else c for name, c in codes.items()}
    print(f"[suite] lanes exited {codes}; {n['tests']} of {want} collected tests ran in {wall / 60:.1f} min")
    if n["tests"] < want and not extra:
        print(f"[suite] {want - n['tests']} collected tests never ran: failing", flush=True)
    if twice:
        print(f"[suite] {len(twice)} tests ran in two lanes (so as many others may not have run): {twice[:5]}; "
              "failing", flush=True)  # fmt: skip
    print(f"{n['passed']} passed, {failed} failed, {n['skipped']} skipped", flush=True)
    return 0 if all(c == 0 for c in codes.values()) and ran_all and failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

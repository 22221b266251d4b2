"""The benchmark tooling on CPU: the profiler wrapper around an unchanged script, and the summary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import summarize

ROOT = Path(__file__).resolve().parents[2]

TOY = """
import json, torch
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
opt = torch.optim.AdamW(model.parameters())
for _ in range(20):
    model(torch.randn(32, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad()
print("RESULT " + json.dumps({"steps": 20}))
"""


def test_profile_run_records_the_chosen_steps_of_an_unchanged_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TOY)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "profile_run.py"), "--out", str(tmp_path / "out"), "--label", "toy",
         "--skip", "5", "--active", "4", str(script)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in proc.stdout.splitlines() if " " in line}
    assert json.loads(lines["RESULT"]) == {"steps": 20}  # the script ran to its end, output intact
    profile = json.loads(lines["PROFILE"])
    assert profile["label"] == "toy" and profile["step_ms"] > 0
    assert profile["kernel_ms_per_step"]["matmul"] > 0
    table = (tmp_path / "out" / "profile-toy.txt").read_text()
    step_row = next(row for row in table.splitlines() if row.strip().startswith("ProfilerStep*"))
    assert step_row.split()[-1] == "4"  # exactly the --active optimizer steps were recorded


def test_summary_takes_medians_of_repeated_arms_and_pairs_only_within_a_run(tmp_path):
    def arm(label, tps):
        payload = {"tok_s_gpu": tps, "mfu": tps / 1e5, "peak_alloc_gib": 1.0, "peak_reserved_gib": 2.0}
        return f"ARM {label} RESULT {json.dumps(payload)}"

    run = tmp_path / "h200x2-fsdp-run9.txt"
    run.write_text("\n".join([
        "# header lines are ignored",
        arm("ref-b4", 100), arm("trainer-b4", 99), arm("ref-b4", 104), arm("trainer-b4", 103),
        arm("ref-b4", 102), arm("trainer-b4", 105), arm("trainer-b16", 120),
    ]))  # fmt: skip
    other = tmp_path / "h200x2-fsdp-run10.txt"
    other.write_text(arm("ref-b16", 50))
    runs = {f.stem.replace("h200x2-", ""): summarize.parse(f) for f in (run, other)}
    rows = summarize.throughput_table(runs)
    assert len(rows) == 3  # header, separator, b4; b16's reference is in another run
    assert "| fsdp-run9 | b4 | 102 | 103 | 1.010 (0.952-1.050, n=3) |" in rows[2]
    only = summarize.trainer_only_table(runs)
    assert any("| fsdp-run9 | b16 | 120 |" in row for row in only)


# Stands in for torchrun so the driver's own logic (order, arguments, budget) runs without GPUs.
FAKE_TORCHRUN = """#!/usr/bin/env bash
shift 3  # --standalone --nproc-per-node N
script="$1"; shift
echo "RESULT {\\"script\\": \\"$(basename "$script")\\", \\"args\\": \\"$*\\"}"
"""


def run_driver(tmp_path, *phases, **env):
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "torchrun").write_text(FAKE_TORCHRUN)
    (bindir / "torchrun").chmod(0o755)
    out = tmp_path / "out"
    full_env = {"PATH": f"{bindir}:/usr/bin:/bin", "OUT": str(out), **env}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "run_h200.sh"), *phases], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return out


def arm_lines(path: Path) -> list[tuple[str, dict]]:
    return [(line.split()[1], json.loads(line.split(" ", 3)[3])) for line in path.read_text().splitlines()
            if line.startswith("ARM ")]  # fmt: skip


def test_repeated_pairs_swap_which_side_goes_first_and_pass_the_same_settings(tmp_path):
    out = run_driver(tmp_path, "eager", REPEAT="3", BATCH="8")
    arms = arm_lines(out / "eager.txt")
    fsdp = [label for label, _ in arms if label.endswith("fsdp2-b8")]
    assert fsdp == ["ref-fsdp2-b8", "trainer-fsdp2-b8", "trainer-fsdp2-b8", "ref-fsdp2-b8", "ref-fsdp2-b8",
                    "trainer-fsdp2-b8", "profile-ref-fsdp2-b8", "profile-trainer-fsdp2-b8"]  # fmt: skip
    by_label = dict(arms)
    settings = "--batch 8 --steps 20"
    assert by_label["ref-fsdp2-b8"] == {"script": "reference_fsdp_zero2.py", "args": f"--strategy fsdp2 {settings}"}
    assert by_label["trainer-fsdp2-b8"] == {"script": "bench_trainer.py", "args": f"--strategy fsdp {settings}"}
    assert by_label["trainer-zero2-b8"]["args"] == f"--strategy zero2 {settings}"
    assert by_label["profile-trainer-fsdp2-b8"]["script"] == "profile_run.py"


def test_arms_past_the_time_budget_are_skipped_and_named(tmp_path):
    out = run_driver(tmp_path, "compiled", BUDGET_S="0")
    text = (out / "compiled.txt").read_text()
    assert not arm_lines(out / "compiled.txt")
    assert "# SKIPPED ref-fsdp2-b4-compiled (budget of 0s spent)" in text
    assert "# SKIPPED trainer-fsdp2-b4-compiled-1gpu (budget of 0s spent)" in text


def test_recovery_phases_are_split_at_the_moments_seen_and_logged():
    import recovery

    log = "\n".join([
        "some torchrun output",
        'METRICS {"event": "started", "world": 4, "time": 90.0}',  # the earlier attempt's pod, not this one
        'METRICS {"event": "started", "world": 4, "time": 107.0}',
        'METRICS {"event": "resumed", "step": 20, "time": 109.5}',
        'METRICS {"step": 21, "loss": 3.2, "time": 110.0}',
        'METRICS {"step": 22, "loss": 3.1, "time": 110.2}',
    ])  # fmt: skip
    marks = {"fault": 100.0, "detect": 101.0, "delete": 103.0, "schedule": 103.5, "start": 104.0}
    marks.update(recovery.trainer_marks(log, after=103.0))
    phases = recovery.breakdown(marks)
    assert phases == {"detect": 1.0, "delete": 2.0, "schedule": 0.5, "start": 0.5, "rendezvous": 3.0, "load": 2.5,
                      "first step": 0.5, "total": 10.0}  # fmt: skip
    in_place = {**{p: 0.0 for p in phases}, "rendezvous": 2.0, "load": 1.5, "first step": 0.5, "total": 4.0}
    table = recovery.table(
        [{"mode": "gang", "fault": "pod-kill", "new_attempts": 1, "phases": phases}] * 2
        + [{"mode": "in-place", "fault": "pod-kill", "new_attempts": 0, "phases": in_place}]
    )
    assert "| gang | pod-kill | 2 | 1 | 1.0 | 2.0 | 0.5 | 0.5 | 3.0 | 2.5 | 0.5 | 10.0 | 1.00x |" in table
    assert "| in-place | pod-kill | 1 | 0 | 0.0 | 0.0 | 0.0 | 0.0 | 2.0 | 1.5 | 0.5 | 4.0 | 2.50x |" in table


def test_a_recovery_without_a_resume_has_no_first_step_yet():
    import recovery

    assert "first step" not in recovery.trainer_marks('METRICS {"step": 1, "time": 5.0}', after=0)

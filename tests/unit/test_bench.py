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

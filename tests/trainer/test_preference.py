"""Preference training (objective dpo) under real torchrun (2 agents x 2 processes, gloo): a preference a tiny
model can learn (the chat task's right answer over two other words) learned under FSDP2 and ZeRO-2, with LoRA
(reference: adapters off) and full weights (reference: precomputed on the claim), on two architectures; a
SIGTERM mid-epoch and an exact resume; exports that transformers and peft load and that prefer the chosen
answers on held-out pairs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from sharded_trainer.checkpoint.manager import committed_steps, step_dir
from sharded_trainer.modeling.dpo import pair_rows, sequence_logps
from support.torchrun_jobs import run_job, run_many, stop_at_step, write_config
from tinyhf import write_model, write_preference_data

pytestmark = pytest.mark.trainer
STEPS = 40
# (architecture, strategy, lora): each strategy with and without LoRA, over two architectures (Gemma: tied
# embeddings, which ZeRO-2's adapter-only checkpoint must leave out).
RUNS = [("llama", "fsdp", False), ("llama", "zero2", True), ("gemma", "fsdp", True), ("gemma", "zero2", False)]
# The full-weight runs again with a frozen copy of the model as the reference (sharded by FSDP2, whole under ZeRO-2).
COPIES = [("llama", "fsdp"), ("gemma", "zero2")]


@pytest.fixture(scope="module")
def claim(tmp_path_factory):
    root = tmp_path_factory.mktemp("preference-claim")
    for i, arch in enumerate({a for a, _, _ in RUNS}):
        write_model(root / "models" / arch, arch, seed=i)
    write_preference_data(root / "data" / "pairs.jsonl", 360)
    return root


def dpo_config(directory: Path, claim: Path, arch: str, strategy: str, lora: bool, **overrides) -> Path:
    settings = {
        "model.preset": None, "model.huggingface.path": str(claim / "models" / arch),
        "data.source": "jsonl", "data.path": str(claim / "data" / "pairs.jsonl"), "data.evalFraction": 0.15,
        "data.evalEvery": 20, "objective.type": "dpo", "objective.dpo.beta": 0.1, "strategy.type": strategy,
        "steps": STEPS, "seqLen": 16, "microBatchSize": 4, "exportOnSuccess": True,
        "optimizer.lr": 0.01 if lora else 0.003, "optimizer.weightDecay": 0.0, "checkpoint.interval": 20,
        **({"lora.r": 8, "lora.alpha": 16} if lora else {}),
    }  # fmt: skip
    return write_config(directory, **{**settings, **overrides})


@pytest.fixture(scope="module")
def runs(claim, tmp_path_factory):
    """Every run of RUNS and COPIES in one launch; each run's directory and metrics by its settings (a copy's
    as (arch, strategy, "copy"))."""
    tmp = tmp_path_factory.mktemp("preference")
    configs = [dpo_config(tmp / "-".join(map(str, combo)), claim, *combo) for combo in RUNS]
    configs += [dpo_config(tmp / f"{arch}-{strategy}-copy", claim, arch, strategy, False,
                           **{"objective.dpo.reference": "copy"}) for arch, strategy in COPIES]  # fmt: skip
    keys = RUNS + [(arch, strategy, "copy") for arch, strategy in COPIES]
    done = run_many(tmp, configs, env={"DS_ACCELERATOR": "cpu"}, timeout=900)
    return {key: (config.parent, run) for key, config, run in zip(keys, configs, done, strict=True)}


def held_out_pairs(run_dir: Path, claim: Path):
    """The held-out pairs as the trainer made them (its tokenized cache on the claim), as one batch."""
    from sharded_api.loading import load_config
    from sharded_trainer.data.preference import PreferenceSource
    from sharded_trainer.data.sources import collate

    cfg = load_config(str(run_dir / "trainer.yaml"), None)
    [cache] = [p for p in (run_dir / "ckpt" / "tokenized").iterdir() if p.is_dir()]
    source = PreferenceSource(cfg.data, cache, cfg.seq_len, 10_000, eval_split=True)
    return collate([source.pair(int(r)) for r in source.records])


def implicit_reward_accuracy(policy, reference, batch) -> float:
    """The share of pairs on which the policy raised the chosen answer over the rejected one relative to the
    reference: the DPO reward accuracy, computed here from the exported model alone."""
    rows, targets = pair_rows(batch.inputs), pair_rows(batch.targets)
    with torch.no_grad():
        mine, _ = sequence_logps(policy(rows).logits, targets)
        theirs, _ = sequence_logps(reference(rows).logits, targets)
    chosen, rejected = (mine - theirs).chunk(2)
    return float((chosen > rejected).float().mean())


@pytest.mark.parametrize(
    ("arch", "strategy", "lora"), RUNS, ids=lambda v: ("lora" if v else "full") if isinstance(v, bool) else v
)
def test_a_preference_is_learned_and_the_export_prefers_the_chosen_answers(runs, claim, arch, strategy, lora):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    directory, run = runs[arch, strategy, lora]
    records = [m for m in run.metrics if "reward_accuracy" in m]
    assert [m["step"] for m in records] == list(range(1, STEPS + 1)), records[:3]
    # Step 1's policy is its reference: every reward 0, the loss ln 2. The next few are near chance.
    assert records[0]["loss"] == pytest.approx(0.693147, abs=1e-4) and records[0]["reward_accuracy"] == 0
    assert sum(m["reward_accuracy"] for m in records[1:6]) / 5 < 0.8, records[:6]
    evals = [m for m in run.metrics if m.get("event") == "eval"]
    assert [e["step"] for e in evals] == [20, 40], evals
    assert evals[-1]["eval_reward_accuracy"] > 0.9 and evals[-1]["eval_reward_margin"] > 0, evals
    assert evals[-1]["eval_loss"] < 0.6, evals
    reference_event = run.event("reference")
    assert (reference_event is not None) == (not lora), reference_event  # precomputed for full weights only
    if not lora:
        assert reference_event["records"] == 360 and (Path(reference_event["path"]) / "logps.npy").is_file()

    base_dir = str(claim / "models" / arch)
    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    exported = run.event("exported")["path"]
    if lora:
        policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), exported).eval()
        assert json.loads((Path(exported) / "adapter_config.json").read_text())["r"] == 8
    else:
        policy = AutoModelForCausalLM.from_pretrained(exported).eval()
    pairs = held_out_pairs(directory, claim)
    assert implicit_reward_accuracy(policy, base, pairs) > 0.9
    assert implicit_reward_accuracy(base, base, pairs) == 0.0  # no preference without training (ties)


@pytest.mark.parametrize(("arch", "strategy"), COPIES)
def test_a_frozen_copy_as_the_reference_trains_as_the_precomputed_reference_does(runs, arch, strategy):
    """The same full-weight run with its reference as a frozen copy of the starting model instead of log-
    probabilities precomputed on the claim: nothing is precomputed, and every step's loss and rewards (and the
    held-out ones) are the precomputed run's: the copy is the starting model and stays it (a copy that trained,
    or kept the adapters, would drift from the numbers computed before the first step)."""
    copy_dir, copy = runs[arch, strategy, "copy"]
    _, precomputed = runs[arch, strategy, False]
    assert copy.event("reference") is None and not (copy_dir / "ckpt" / "reference").exists()
    want = {m["step"]: m for m in precomputed.metrics if "reward_accuracy" in m}
    got = {m["step"]: m for m in copy.metrics if "reward_accuracy" in m}
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step, m in got.items():
        for key in ("loss", "reward_margin", "chosen_reward", "rejected_reward", "reward_accuracy"):
            assert m[key] == pytest.approx(want[step][key], rel=1e-3, abs=1e-4), (step, key, m, want[step])

    def evals(run) -> list[float]:
        return [e[k] for e in run.metrics if e.get("event") == "eval" for k in ("eval_loss", "eval_reward_accuracy")]

    assert len(evals(copy)) == 4 and evals(copy) == pytest.approx(evals(precomputed), rel=1e-3)
    assert evals(copy)[-1] > 0.9


def test_dpo_stopped_mid_epoch_resumes_exactly(runs, claim, tmp_path):
    """Full weights under FSDP2, stopped as a pod deletion would: the final checkpoint, then a resume that
    reuses the precomputed reference on the claim and matches the uninterrupted run's loss and rewards at every
    step after it."""
    _, reference = runs["llama", "fsdp", False]
    config = dpo_config(tmp_path, claim, "llama", "fsdp", False, exportOnSuccess=False)
    stopped = stop_at_step(config, tmp_path / "progress.json", 8, tmp_path / "logs-a")
    preempted = stopped.event("preempted")
    assert preempted, stopped.output[-3000:]
    at = preempted["step"]
    assert 8 <= at < STEPS and at in committed_steps(tmp_path / "ckpt")
    state = json.loads((step_dir(tmp_path / "ckpt", at) / "trainer.json").read_text())
    assert state["data"]["consumed"] == at * 4 * 4

    resumed = run_job(tmp_path, config, timeout=600)
    assert resumed.returncodes == [0, 0], resumed.output[-3000:]
    assert resumed.event("resumed")["step"] == at
    assert resumed.event("reference")["path"] == stopped.event("reference")["path"]  # read, not recomputed
    want = {m["step"]: m for m in reference.metrics if "reward_accuracy" in m}
    got = {m["step"]: m for m in resumed.metrics if "reward_accuracy" in m}
    assert sorted(got) == list(range(at + 1, STEPS + 1))
    for step, m in got.items():
        for key in ("loss", "reward_accuracy", "reward_margin", "chosen_reward", "rejected_reward"):
            assert m[key] == pytest.approx(want[step][key], rel=1e-4, abs=1e-5), (step, key, m, want[step])


def test_dpo_resumes_on_half_the_world_and_recomputes_a_damaged_reference(runs, claim, tmp_path):
    """The full-weights FSDP2 run's checkpoints (world 4) resumed on one node of 2 processes for 6 more steps,
    after a NaN was written into the reference on the claim: the damaged file is set aside and computed again
    from the starting weights (before the checkpoint is loaded) on the smaller world, matching the first one,
    and the preference keeps being held."""
    import numpy as np

    directory, first = runs["llama", "fsdp", False]
    shutil.copytree(directory / "ckpt", tmp_path / "ckpt")
    reference = Path(first.event("reference")["path"])
    mine = tmp_path / "ckpt" / "reference" / reference.name
    original = np.load(mine / "logps.npy")
    damaged = original.copy()
    damaged[7, 1] = np.nan
    np.save(mine / "logps.npy", damaged)

    config = dpo_config(tmp_path, claim, "llama", "fsdp", False, steps=STEPS + 6, exportOnSuccess=False)
    run = run_job(tmp_path, config, nodes=1, procs=2, timeout=600)
    assert run.returncodes == [0], run.output[-3000:]
    aside = run.event("reference_set_aside")
    assert aside == {**aside, "path": str(mine / "logps.npy.damaged"), "reason": "values that are not finite"}
    assert run.event("reference")["path"] == str(mine)
    np.testing.assert_allclose(np.load(mine / "logps.npy"), original, rtol=1e-5, atol=1e-5)
    assert run.event("resumed") == {**run.event("resumed"), "step": STEPS, "from_world": 4, "world": 2}
    records = [m for m in run.metrics if "reward_accuracy" in m]
    assert [m["step"] for m in records] == list(range(STEPS + 1, STEPS + 7)), records
    assert sum(m["reward_accuracy"] for m in records) / len(records) > 0.7, records

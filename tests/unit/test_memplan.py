"""The memory model (sharded_trainer.memplan) against the peak GPU memory the trainer reached on H200s, from
the runs kept in bench/results: every run of the current loss (run 5 on) that was not used to fit the model's
four constants, the 8B-shape LoRA and QLoRA runs of both strategies, and the trainer's arms of
bench/hf_pairs.sh."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import auto_check
import pytest
from memplan_check import held_out_runs, result

from sharded_api.loading import ConfigError
from sharded_api.quantity import memory_bytes
from sharded_trainer import autoplan, memplan
from sharded_trainer.memplan import GIB, Job, Setting, estimate, load_shape

ROOT = Path(__file__).resolve().parents[2]


def test_the_runs_held_out_cover_every_option_the_model_has():
    runs = held_out_runs()
    configurations = {(job, setting) for _, _, job, setting, _ in runs}
    assert len(configurations) >= 8, configurations
    settings = {setting for _, _, _, setting, _ in runs}
    assert {Setting("fsdp"), Setting("fsdp", reshard=False), Setting("zero2"), Setting("fsdp", offload=True),
            Setting("zero2", checkpointing=True), Setting("zero2", offload=True)} <= settings  # fmt: skip
    assert {job.nf4 for _, _, job, _, _ in runs if job.lora_r} == {False, True}
    assert {job.world for _, _, job, _, _ in runs} == {1, 2} and any(job.compile for _, _, job, _, _ in runs)


@pytest.mark.parametrize(("name", "arm", "job", "setting", "measured"), held_out_runs(),
                         ids=lambda v: v if isinstance(v, str) else None)  # fmt: skip
def test_each_prediction_is_within_ten_percent_of_the_measured_peak(name, arm, job, setting, measured):
    predicted = estimate(job, setting).peak / GIB
    assert predicted == pytest.approx(measured, rel=0.10), (setting.label, predicted, measured)


def test_on_the_gpu_auto_never_ran_out_of_memory_and_the_rule_still_chooses_what_ran():
    """bench/auto_check.py on one H200 held to each case's limit: the setting the trainer chose ran without
    running out of memory, its prediction within 10% of the peak it reached, and the current rule picks it
    again (a change to the rule or the model must be measured anew); where nothing fits, the trainer stopped
    before loading the model with the error that says what to change."""
    rows = auto_check.records(auto_check.RESULTS / name for name in auto_check.CURRENT)
    assert [r["name"] for r in rows] == [c.name for c in auto_check.CASES]
    assert len({auto_check.chosen_label(r["why"]) for r in rows}) >= 6  # the choices span the settings
    for r in rows:
        label = auto_check.chosen_label(r["why"])
        assert not r["oom"] and label == auto_check.choice_now(r), r
        if label is None:
            assert "no setting fits" in r["error"][0] and r["steps"] == 0, r
            continue
        assert r["rc"] == 0 and r["steps"] == 6, r
        predicted = estimate(auto_check.job_of(r), next(s for s in memplan.SETTINGS if s.label == label)).peak
        assert predicted / GIB == pytest.approx(r["peak_alloc_gib"], rel=0.10), r


def test_zero2_counts_the_bf16_base_it_loads_before_quantizing_it_to_nf4():
    """The ZeRO-2 QLoRA load peak on an H200 (bench/qlora.sh's LOAD line): the whole bf16 base and its NF4
    form at once. Auto chose ZeRO-2 for QLoRA on a 16 GiB limit before this was counted, and ran out of memory."""
    line = next(ln for ln in result("qlora-8b-zero2-h200x1.txt").read_text().splitlines()
                if ln.startswith("zero2 qlora LOAD "))  # fmt: skip
    measured = json.loads(line.split(" LOAD ", 1)[1])["gpu_allocated_gib"]
    job = Job(load_shape("llama-8b"), 1, 2, 2048, 16, True)
    assert estimate(job, Setting("zero2", checkpointing=True)).load / GIB == pytest.approx(measured, rel=0.05)
    assert estimate(job, Setting("fsdp")).load == 0  # FSDP2 quantizes each weight as it is read


def test_an_nf4_base_is_never_offloaded_by_fsdp2():
    job = Job(load_shape("llama-8b"), 1, 2, 2048, 16, True)
    estimates, chosen = memplan.plan(job, 12 * GIB)
    offload = next(e for e in estimates if e.setting == Setting("fsdp", checkpointing=True, offload=True))
    assert offload.peak < memplan.usable(12 * GIB) and chosen is None
    assert "not with NF4" in autoplan.table(job, 12 * GIB)


def test_the_parameter_count_is_the_models():
    assert load_shape("llama-1b").params == 1_235_814_400  # the runs' own count
    assert load_shape("llama-8b").params == 8_030_261_248  # Llama-3-8B


def test_a_hugging_face_directory_is_read_from_its_config(tmp_path):
    from tinyhf import write_model

    write_model(tmp_path / "qwen3", "qwen3")
    config = json.loads((tmp_path / "qwen3" / "config.json").read_text())
    shape = load_shape(str(tmp_path / "qwen3"))
    assert (shape.hidden, shape.layers, shape.vocab) == (config["hidden_size"], config["num_hidden_layers"],
                                                         config["vocab_size"])  # fmt: skip
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "qwen3"))
    counted = sum(p.numel() for p in model.parameters())
    # Qwen3's per-head q/k norms and any biases are not counted: a few hundred parameters of a tiny model.
    assert shape.params == pytest.approx(counted, rel=0.02)


def test_the_plan_picks_the_fastest_setting_that_fits_and_says_when_nothing_does():
    shape = load_shape("llama-8b")
    estimates, chosen = memplan.plan(Job(shape, 16, 2, 2048), 80 * GIB)
    assert chosen is estimates[0] and chosen.setting == Setting("fsdp", reshard=False)
    # Twice the micro-batch: every block gathered until backward no longer fits beside the activations.
    _, chosen = memplan.plan(Job(shape, 16, 4, 2048), 80 * GIB)
    assert chosen.setting == Setting("fsdp")
    # Full fine-tuning of 8B on 2 GPUs of 80 GiB: the fp32 state alone is 45 GiB a GPU; checkpointing fits.
    estimates, chosen = memplan.plan(Job(shape, 2, 4, 2048), 80 * GIB)
    assert chosen is not None and chosen.setting.checkpointing and chosen.peak <= 0.9 * 80 * GIB
    assert all(e.peak > 0.9 * 80 * GIB for e in estimates[: estimates.index(chosen)])
    _, chosen = memplan.plan(Job(shape, 1, 64, 8192), 24 * GIB)
    assert chosen is None


def test_the_plan_command_prints_the_table():
    out = subprocess.run(
        [sys.executable, "-m", "sharded_trainer", "plan", "--model", "llama-8b", "--nodes", "1", "--gpus-per-node",
         "2", "--gpu-memory", "80Gi", "--micro-batch", "4", "--seq", "2048"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "8.03B parameters" in out and "<- chosen" in out and "activationCheckpointing" in out
    bad = subprocess.run([sys.executable, "-m", "sharded_trainer", "plan", "--model", "/no/such", "--nodes", "1",
                          "--gpus-per-node", "1", "--gpu-memory", "80Gi"], capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and "--model /no/such" in bad.stderr


def test_gpu_memory_is_read_as_kubernetes_quantities():
    assert memory_bytes("80Gi") == 80 * GIB and memory_bytes("141G") == 141e9 and memory_bytes("2e9") == 2e9
    assert memory_bytes("80GiB") == 80 * GIB
    # "m" is milli, as in every Kubernetes quantity (80m bytes is no memory size), never mega
    for hostile in ("nan", "inf", "-80Gi", "0", "1e400Gi", "80 parsecs", "", "Gi", "B", "800m", "80g"):
        with pytest.raises(ValueError, match="is not a memory size: write one such as 80Gi"):
            memory_bytes(hostile)
    out = sharded("plan", "-f", "examples/fsdp-8gpu-infiniband.yaml", "--gpu-memory", "nanGi")
    assert out.returncode == 1 and "error: --gpu-memory 'nanGi' is not a memory size" in out.stderr, out.stderr


def sharded(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sharded_operator.cli.main", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)  # fmt: skip


def test_sharded_plan_reads_the_job_from_its_manifest(tmp_path):
    """`sharded plan`: nodes x processes, micro-batch and seq from the manifest (and --set); the model from a
    preset, or from a local copy of the config.json of a model that lives on the job's claim."""
    out = sharded("plan", "-f", "examples/fsdp-8gpu-infiniband.yaml", "--gpu-memory", "80Gi")
    assert out.returncode == 0, out.stderr
    assert "1.24B parameters" in out.stdout and "32 processes, micro-batch 8 x seq 2048" in out.stdout
    assert "<- chosen" in out.stdout
    changed = sharded("plan", "-f", "examples/fsdp-8gpu-infiniband.yaml", "--gpu-memory", "80Gi",
                      "--set", "trainer.microBatchSize=64")  # fmt: skip
    assert "micro-batch 64 x seq 2048" in changed.stdout and "nothing fits" in changed.stdout
    # The manifest's precision is what auto would plan with: bf16-pure's state, FSDP2's settings only.
    pure = sharded("plan", "-f", "examples/fsdp-8gpu-infiniband.yaml", "--gpu-memory", "80Gi",
                   "--set", "trainer.precision=bf16-pure")  # fmt: skip
    assert pure.returncode == 0, pure.stderr
    assert ", bf16-pure;" in pure.stdout and "zero2" in out.stdout and "zero2" not in pure.stdout

    def state(text: str) -> float:  # the state column of the plain FSDP2 row, GiB
        return float(next(line.split()[1] for line in text.splitlines() if line.startswith("fsdp ")))

    assert state(pure.stdout) == pytest.approx(state(out.stdout) / 2, abs=0.1)

    on_claim = sharded("plan", "-f", "examples/qwen-qlora-chat.yaml", "--gpu-memory", "80Gi")
    assert on_claim.returncode == 1 and "give --model with a local copy" in on_claim.stderr
    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "config.json").write_text(json.dumps({  # Qwen2.5-7B-Instruct's shape
        "model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False,
    }))  # fmt: skip
    local = sharded("plan", "-f", "examples/qwen-qlora-chat.yaml", "--gpu-memory", "80Gi", "--model", str(qwen))
    assert local.returncode == 0, local.stderr
    assert "7.62B parameters" in local.stdout and "LoRA r16 on an NF4 base" in local.stdout


def auto_config(**changes):
    from sharded_api.config import TrainerConfig

    body = {"model": {"preset": "llama-8b"}, "microBatchSize": 4, "seqLen": 2048, "strategy": {"type": "auto"},
            "precision": "bf16"}  # fmt: skip
    return TrainerConfig.model_validate({**body, **changes})


def test_auto_settles_on_the_fastest_setting_that_fits_and_keeps_the_other_options():
    cfg = auto_config(strategy={"type": "auto", "fsdp": {"compile": True, "prefetch": 2}})
    settled, why = autoplan.settle(cfg, 2, 80 * GIB)
    assert settled.strategy.type == "fsdp" and settled.strategy.fsdp.activation_checkpointing
    assert settled.strategy.fsdp.compile and settled.strategy.fsdp.prefetch == 2  # the user's, untouched
    assert why.startswith("auto: fsdp+activationCheckpointing") and "fsdp would need 101.4" in why
    settled, why = autoplan.settle(cfg, 64, 80 * GIB)
    assert settled.strategy.type == "fsdp" and not settled.strategy.fsdp.reshard_after_forward
    assert "would need" not in why


def test_auto_keeps_the_strategy_of_the_checkpoint_and_zero2_for_fp16():
    settled, why = autoplan.settle(auto_config(), 64, 80 * GIB, kept="zero2")
    assert settled.strategy.type == "zero2" and "the newest checkpoint is zero2's" in why
    settled, _ = autoplan.settle(auto_config(precision="fp16"), 64, 80 * GIB)
    assert settled.strategy.type == "zero2"
    settled, why = autoplan.settle(auto_config(), 2, None)
    assert settled.strategy.type == "fsdp" and "no GPU" in why


def test_bf16_pure_keeps_eight_bytes_per_parameter_and_auto_keeps_it_on_fsdp2_without_offload():
    """bf16 weights, gradients and moments: the state is half of mixed precision's; auto chooses among FSDP2's
    settings only, and never one that offloads (the rule on precision)."""
    shape = load_shape("llama-8b")
    mixed, pure = Job(shape, 8, 4, 2048), Job(shape, 8, 4, 2048, precision="bf16-pure")
    plain = Setting("fsdp")
    assert estimate(mixed, plain).state == pytest.approx(16 * shape.params / 8)
    assert estimate(pure, plain).state == pytest.approx(8 * shape.params / 8)
    assert memplan.strategy_types("bf16-pure") == {"fsdp"}
    one = Job(shape, 1, 4, 2048, precision="bf16-pure")
    estimates, chosen = memplan.plan(one, 80 * GIB)
    assert chosen is not None and chosen.setting == Setting("fsdp", checkpointing=True)
    # One process storing bf16 runs the model unsharded: the state and gradients, nothing gathered or reduced
    # (sharded, the root's gradients go through reduce buffers and the output head is gathered: 5.3 GiB more).
    assert chosen.peak == pytest.approx(59.8 * GIB, abs=0.05 * GIB)
    assert chosen.transient == 0
    mixed_one = estimate(Job(shape, 1, 4, 2048), chosen.setting)
    assert mixed_one.transient > 0 and mixed_one.peak > mixed_one.state + mixed_one.transient
    assert all(e.setting.strategy == "fsdp" for e in estimates)
    assert "not with bf16-pure" in autoplan.table(one, 80 * GIB) and "zero2" not in autoplan.table(one, 80 * GIB)
    settled, why = autoplan.settle(auto_config(precision="bf16-pure"), 1, 80 * GIB)
    assert settled.strategy.type == "fsdp" and settled.strategy.fsdp.activation_checkpointing, why
    with pytest.raises(ConfigError, match="no setting fits"):  # mixed precision would offload here; pure cannot
        autoplan.settle(auto_config(precision="bf16-pure"), 1, 48 * GIB)


def test_auto_refuses_before_training_when_nothing_fits():
    from sharded_api.loading import ConfigError

    fits = r"no setting fits in 20.6 GiB \(90% of the GPU's 24 GiB less 1 GiB\) at microBatchSize 64"
    with pytest.raises(ConfigError, match=fits):
        autoplan.settle(auto_config(microBatchSize=64), 1, 24 * GIB)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[1, 2]", "config.json is not a JSON object"),
        ("{not json", "config.json: Expecting property name"),
        ('{"model_type": "olmo", "hidden_size": 64, "num_attention_heads": 4}', "num_hidden_layers must be"),
        ('{"model_type": "olmo", "hidden_size": -1, "num_attention_heads": 4}', "must be a whole number from 1"),
        ('{"model_type": "olmo", "hidden_size": 1e300, "num_attention_heads": 4}', "hidden_size must be"),
        ('{"model_type": "olmo", "hidden_size": 99999999999, "num_attention_heads": 4}', "(got 99999999999)"),
        ('{"model_type": "olmo", "hidden_size": true, "num_attention_heads": 4}', "hidden_size must be"),
        ('{"text_config": "x"}', "text_config is not a JSON object"),
    ],
)
def test_a_hostile_config_json_is_refused_naming_the_field(tmp_path, content, message):
    refused(tmp_path, content, ValueError, message, r"model\.huggingface\.path")


def refused(directory, content: str, error: type, message: str, auto_says: str) -> None:
    """config.json holding `content`: `plan` raises `error` naming it, and `strategy.type: auto` a config error."""
    from sharded_api.loading import ConfigError

    (directory / "config.json").write_text(content)
    with pytest.raises(error, match=r"config\.json") as e:
        load_shape(str(directory))
    assert message in str(e.value)
    cfg = auto_config(model={"huggingface": {"path": str(directory)}, "preset": None})
    with pytest.raises(ConfigError, match=auto_says):
        autoplan.settle(cfg, 2, 80 * GIB)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model_type": "mixtral", "num_local_experts": 8}, "mixtral routes tokens to experts (num_local_experts 8)"),
        ({"model_type": "qwen3_moe", "num_experts": 128}, "qwen3_moe routes tokens to experts (num_experts 128)"),
        ({"model_type": "mamba"}, "model_type 'mamba' is not modelled"),
        ({"hidden_size": 64}, "model_type None is not modelled"),
    ],
)
def test_a_model_the_memory_model_does_not_cover_is_named_and_auto_asks_for_a_strategy(tmp_path, config, message):
    from sharded_trainer.memplan import NotModelled

    auto_says = r"strategy\.type auto: .* set strategy\.type to fsdp or zero2"
    refused(tmp_path, json.dumps(config), NotModelled, message, auto_says)


def test_a_plain_mlp_counts_two_linears_and_a_gated_one_three():
    from sharded_trainer.memplan import Shape

    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 256,
            "vocab_size": 100}  # fmt: skip
    gated, plain = (Shape.from_hf_config({**base, "model_type": t}) for t in ("llama", "gpt_neox"))
    assert gated.block_linear_params - plain.block_linear_params == 64 * 256
    assert plain.block_act_bytes() < gated.block_act_bytes()


@pytest.mark.parametrize(
    "content", ["", "[]", '{"fingerprint": 3}', '{"fingerprint": {"strategy": "zero3"}}', '{"fingerprint": {}}']
)
def test_a_checkpoint_that_does_not_name_its_strategy_names_none(tmp_path, content):
    from sharded_trainer.checkpoint.manager import saved_strategy

    (tmp_path / "trainer.json").write_text(content)
    assert saved_strategy(tmp_path) is None
    assert saved_strategy(tmp_path / "missing") is None


def test_exporting_an_auto_run_whose_checkpoint_does_not_name_its_strategy_exits_2_saying_so(tmp_path, capsys):
    from sharded_api.contract import MARKER, TRAINER_STATE
    from sharded_trainer.__main__ import main
    from sharded_trainer.checkpoint.manager import step_dir

    step = step_dir(tmp_path / "ckpt", 10)
    step.mkdir(parents=True)
    (step / MARKER).write_text("")
    (step / TRAINER_STATE).write_text('{"step": 10}')  # written before checkpoints carried a fingerprint
    (tmp_path / "job.yaml").write_text("model: {preset: tiny}\nstrategy: {type: auto}\n")
    args = ["export", "--config", str(tmp_path / "job.yaml"), "--checkpoint", str(step), "--out", str(tmp_path / "o")]
    assert main(args) == 2
    assert "does not say which strategy wrote it; set strategy.type" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["lots", "0", "-40Gi", "nan", "inf", "1e400Gi", "12 parsecs"])
def test_a_bad_gpu_memory_limit_fails_before_training_naming_the_variable(monkeypatch, value):
    import torch

    from sharded_api.loading import ConfigError
    from sharded_trainer.process_group import DistEnv
    from sharded_trainer.train import gpu_memory

    monkeypatch.setenv("SHARDED_GPU_MEMORY_LIMIT", value)
    with pytest.raises(ConfigError, match=r"SHARDED_GPU_MEMORY_LIMIT=.*not a memory size; write one such as 40Gi"):
        gpu_memory(DistEnv(0, 0, 1, "gloo", torch.device("cpu")))
    monkeypatch.setenv("SHARDED_GPU_MEMORY_LIMIT", "40Gi")  # valid: without a GPU there is nothing to hold to it
    assert gpu_memory(DistEnv(0, 0, 1, "gloo", torch.device("cpu"))) is None


def test_auto_plans_compiled_blocks_only_when_both_strategies_compile():
    """Compiled blocks keep fewer activations; auto may pick either strategy, so its plan counts them only
    when the options of both compile (one compiled alone is planned as eager: never short of memory)."""
    both = {"type": "auto", "fsdp": {"compile": True}, "zero2": {"compile": True}}
    assert autoplan.job_of(auto_config(strategy=both), 8).compile
    assert not autoplan.job_of(auto_config(strategy={"type": "auto", "fsdp": {"compile": True}}), 8).compile
    # The 8B shape at 8k tokens on 8 GPUs of 80 GiB: compiled, the fastest setting fits; eager it does not.
    long = {"seqLen": 8192, "microBatchSize": 1}
    compiled, _ = autoplan.settle(auto_config(strategy=both, **long), 8, 80 * GIB)
    eager, why = autoplan.settle(auto_config(**long), 8, 80 * GIB)
    assert not compiled.strategy.fsdp.reshard_after_forward and eager.strategy.fsdp.reshard_after_forward, why


def test_preference_pairs_count_two_rows_per_sample_and_the_reference_pass_its_logits():
    """A DPO micro-batch of B pairs is 2B sequences in one forward pass: the activations of a 2B micro-batch
    of next-token training, the state unchanged; a precomputed reference adds nothing."""
    shape = load_shape("llama-1b")
    setting = Setting("fsdp", checkpointing=True)
    pairs = estimate(Job(shape, 8, 2, 2048, lora_r=16, rows=2), setting)
    doubled = estimate(Job(shape, 8, 4, 2048, lora_r=16), setting)
    single = estimate(Job(shape, 8, 2, 2048, lora_r=16), setting)
    assert pairs.activations == doubled.activations == 2 * single.activations
    assert pairs.state == single.state and pairs.peak > single.peak
    # With LoRA the reference is a forward pass after the policy's: its logits add to the peak.
    live = estimate(Job(shape, 8, 2, 2048, lora_r=16, rows=2, reference_forward=True), setting)
    assert live.transient - pairs.transient == 2 * 2 * 2048 * shape.vocab * memplan.REFERENCE_LOGIT_BYTES
    records = {"data": {"source": "jsonl", "path": "/p.jsonl", "tokenizer": "/t"}}
    full = autoplan.job_of(auto_config(objective={"type": "dpo"}, **records), 8)
    assert (full.rows, full.reference_forward) == (2, False) and autoplan.job_of(auto_config(), 8).rows == 1


def test_a_frozen_reference_copy_adds_its_bf16_parameters_sharded_as_the_policy_and_its_logits():
    """objective.dpo.reference copy: the starting model again, frozen, in bf16, sharded over the world under
    FSDP2 (whole on every process under ZeRO-2, as the policy's parameters are; offloaded with FSDP2's offload),
    and a forward pass whose logits add to the peak as the adapters-off pass's do; auto's plan counts it."""
    shape = load_shape("llama-8b")  # auto_config's model
    records = {"data": {"source": "jsonl", "path": "/p.jsonl", "tokenizer": "/t"}}
    copy = autoplan.job_of(auto_config(objective={"type": "dpo", "dpo": {"reference": "copy"}}, **records), 8)
    precomputed = autoplan.job_of(auto_config(objective={"type": "dpo"}, **records), 8)
    assert (copy.reference_copy, copy.reference_forward) == (True, True)
    assert (precomputed.reference_copy, precomputed.reference_forward) == (False, False)
    for setting, share in [(Setting("fsdp"), 2 * shape.params / 8), (Setting("zero2"), 2 * shape.params),
                           (Setting("fsdp", checkpointing=True, offload=True), 0.0)]:  # fmt: skip
        with_copy, without = estimate(copy, setting), estimate(precomputed, setting)
        assert with_copy.state - without.state == pytest.approx(share), setting
        assert with_copy.transient - without.transient == 4 * 2 * 2048 * shape.vocab * memplan.REFERENCE_LOGIT_BYTES
    # auto settles on what fits with the copy counted: at a budget where the precomputed job fits its fastest
    # setting and the copy does not, the copy's plan moves down the list.
    fastest = estimate(precomputed, memplan.SETTINGS[0])
    budget = (fastest.peak + estimate(copy, memplan.SETTINGS[0]).peak) / 2
    gpu = (budget + memplan.HEADROOM) / memplan.MARGIN
    assert memplan.plan(precomputed, gpu)[1].setting == memplan.SETTINGS[0]
    assert memplan.plan(copy, gpu)[1].setting != memplan.SETTINGS[0]


def test_offloading_counts_the_state_it_moves_to_the_host_and_auto_refuses_what_the_host_cannot_hold():
    """Held out on an H200 host of 128 GiB: a 7.6B full fine-tune under auto at 80Gi chose ZeRO-2 with the
    optimizer on the CPU and was SIGKILLed by the host. Offloaded, the fp32 master, moments and gradient
    partition (16 bytes per trained parameter) and DeepSpeed's staging live in host memory; auto must count
    them. Held out too: the 1.24B shape on a 12 GiB GPU, offloading under a 24 GiB cgroup, was OOM-killed."""
    shape = load_shape("llama-8b")
    job = Job(shape, 1, 1, 2048)
    offload = estimate(job, Setting("zero2", checkpointing=True, offload=True))
    assert offload.host == pytest.approx(memplan.HOST_BASE + memplan.OFFLOAD_HOST_BYTES * shape.params, rel=1e-9)
    assert estimate(job, Setting("fsdp", checkpointing=True)).host == memplan.HOST_BASE  # nothing offloaded
    lora = estimate(Job(shape, 1, 1, 2048, lora_r=16), Setting("zero2", checkpointing=True, offload=True))
    assert lora.host < memplan.HOST_BASE + 1 * GIB  # only the adapters' state moves
    # On the GPU alone the offloading settings fit; with the host's 128 GiB per process they do not.
    _, chosen = memplan.plan(job, 80 * GIB)
    assert chosen is not None and chosen.setting.offload
    _, chosen = memplan.plan(job, 80 * GIB, host_bytes=128 * GIB)
    assert chosen is None
    cfg = auto_config(model={"preset": "llama-8b"}, microBatchSize=1, seqLen=2048)
    with pytest.raises(ConfigError, match=r"host memory per process.*fits the GPU but needs 1\d\d\.\d GiB of host"):
        autoplan.settle(cfg, 1, 80 * GIB, host_bytes=128 * GIB)
    small = auto_config(model={"preset": "llama-1b"}, microBatchSize=1, seqLen=2048)
    with pytest.raises(ConfigError, match="host memory per process"):
        autoplan.settle(small, 1, 12 * GIB, host_bytes=24 * GIB)  # OOM-killed when planned at 16 bytes
    settled, why = autoplan.settle(small, 1, 12 * GIB, host_bytes=48 * GIB)  # ran, peaking at 31.3 GiB
    assert settled.strategy.zero2.cpu_offload_optimizer and "zero2+activationCheckpointing+cpuOffloadOptimizer" in why
    assert estimate(autoplan.job_of(settled, 1), Setting("zero2", checkpointing=True, offload=True)).host == (
        pytest.approx(31.3 * GIB, rel=0.03)
    )
    # The same job on eight GPUs of one node shares the host eight ways, and shards the state eight ways.
    settled, why = autoplan.settle(cfg, 8, 80 * GIB, host_bytes=128 * GIB / 8)
    assert "auto: " in why and estimate(autoplan.job_of(settled, 8), Setting("fsdp")).host <= 0.9 * 16 * GIB
    # With host to spare, the GPU's plan is unchanged.
    assert (
        autoplan.settle(cfg, 1, 80 * GIB, host_bytes=1024 * GIB)[0].strategy
        == autoplan.settle(cfg, 1, 80 * GIB)[0].strategy
    )


def test_the_host_limit_is_the_containers_cgroup_or_the_machines_memory_whichever_is_less(tmp_path):
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:       134217728 kB\nMemFree: 1 kB\n")  # 128 GiB
    (proc / "self" / "cgroup").write_text("0::/kubepods/pod1/c1\n")
    assert autoplan.host_memory(proc, cgroups) == 128 * GIB  # no cgroup files: the machine's
    (cgroups / "kubepods/pod1/c1").mkdir(parents=True)
    (cgroups / "kubepods/pod1/c1/memory.max").write_text("max\n")
    assert autoplan.host_memory(proc, cgroups) == 128 * GIB
    (cgroups / "kubepods/pod1/c1/memory.max").write_text(f"{40 * GIB}\n")  # the pod's limit, cgroup v2
    assert autoplan.host_memory(proc, cgroups) == 40 * GIB
    (proc / "self" / "cgroup").write_text("4:memory:/\n2:cpuacct:/\n")  # v1, as a container sees its own
    (cgroups / "memory").mkdir()
    (cgroups / "memory/memory.limit_in_bytes").write_text(f"{9223372036854771712}\n")  # v1's "no limit"
    assert autoplan.host_memory(proc, cgroups) == 128 * GIB
    (cgroups / "memory/memory.limit_in_bytes").write_text(f"{24 * GIB}\n")
    assert autoplan.host_memory(proc, cgroups) == 24 * GIB
    (proc / "meminfo").write_text("garbage")
    (proc / "self" / "cgroup").write_text("")
    assert autoplan.host_memory(proc, cgroups) is None


def test_a_malformed_cgroup_listing_is_skipped_not_crashed_on(tmp_path):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:       33554432 kB\n")  # 32 GiB
    (proc / "self" / "cgroup").write_text("no colons here\n\x00\x01:\n" + "x" * 5000 + "\n")
    assert autoplan.host_memory(proc, tmp_path / "cgroup") == 32 * GIB

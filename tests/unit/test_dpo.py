"""Preference training against an independent implementation: TRL's DPOTrainer (pinned, test-only) on the
same weights and records. The records are tokenized by each side on its own (the token ids must agree), then
each side's loss, rewards and gradients are computed in fp32 on a tiny Llama, with full weights (a frozen
reference model) and with LoRA (the reference is the base, adapters off), for each loss type."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from sharded_api.config import TrainerConfig
from sharded_trainer.data import preference
from sharded_trainer.data.records import DataError
from sharded_trainer.data.sources import IGNORE, PairBatch, collate
from sharded_trainer.modeling.decoder import Network
from sharded_trainer.modeling.dpo import pair_rows, sequence_logps
from sharded_trainer.modeling.hf import hf_logits
from sharded_trainer.objective import Preference, reference_kind
from tinyhf import answer, question, write_model

PAIRS = 6
SEQ = 16


def records() -> list[dict]:
    """Chat prompts with the answer as an assistant message or a string, and one plain-text prompt."""
    out = []
    for k in range(PAIRS - 1):
        chosen, rejected = answer(k), answer(k + 3) + (" w1" if k % 2 else "")  # answers of unequal length
        out.append({"prompt": question(k), "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": rejected if k % 2 else {"role": "assistant", "content": rejected}})  # fmt: skip
    return out


@pytest.fixture(scope="module")
def claim(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    model = write_model(root / "llama", "llama", seed=3)
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records()))
    return root, model


def config(root, model, **dpo) -> TrainerConfig:
    return TrainerConfig.model_validate({
        "model": {"huggingface": {"path": str(model)}, "preset": None},
        "data": {"source": "jsonl", "path": str(root / "pairs.jsonl")},
        "objective": {"type": "dpo", "dpo": dpo}, "seqLen": SEQ, "precision": "fp32",
    })  # fmt: skip


def our_batch(root, model, cfg) -> PairBatch:
    cache = root / f"cache-{preference.cache_key(cfg.data, str(model))}"
    if not cache.is_dir():
        preference.build_cache(cfg.data, str(model), cache)
    source = preference.PreferenceSource(cfg.data, cache, SEQ, 10_000)
    return PairBatch(*collate([source.pair(r) for r in range(PAIRS - 1)]))


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")


def set_adapters(model) -> None:
    """Adapters with non-zero B, the same on every copy: the policy is not its reference (adapters off)."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def policy_and_reference(model_dir, lora: bool):
    """A policy that differs from its reference: full weights moved by noise (the reference a frozen copy),
    or LoRA adapters with non-zero B (the reference the same model, adapters off)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = copy.deepcopy(reference)
    if lora:
        policy = get_peft_model(policy, lora_config())
        set_adapters(policy)
    else:
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
    policy.train()
    return policy, None if lora else reference.eval()


def base_of(policy):
    """TRL's own LoRA (peft_config): it adds the adapters to the base and takes the base as the reference (an
    adapter it is handed already made would be its own reference)."""
    return policy.get_base_model() if hasattr(policy, "get_base_model") else policy


def trl_side(model_dir, policy, reference, loss: str, beta: float, *, zero_reference: bool = False, swap=False):
    """TRL's loss (backward run), its logged rewards, and the policy's gradients."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    def message(answer):  # TRL takes one format for a whole dataset: every answer as an assistant message
        answer = answer[0] if isinstance(answer, list) else answer
        return [answer if isinstance(answer, dict) else {"role": "assistant", "content": answer}]

    rows = [{**r, "chosen": message(r["chosen"]), "rejected": message(r["rejected"])} for r in records()]
    if swap:
        rows = [{**r, "chosen": r["rejected"], "rejected": r["chosen"]} for r in rows]
    args = DPOConfig(output_dir=str(model_dir.parent / "trl"), per_device_train_batch_size=PAIRS, beta=beta,
                     loss_type=[loss], report_to=[], use_cpu=True, bf16=False, max_length=None)  # fmt: skip
    lora = hasattr(policy, "get_base_model")
    model = copy.deepcopy(base_of(policy)) if lora else policy
    if lora:  # the base without adapters
        model = type(model).from_pretrained(model_dir, dtype=torch.float32)
    trainer = DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=AutoTokenizer.from_pretrained(model_dir),
                         peft_config=lora_config() if lora else None)  # fmt: skip
    policy = trainer.model
    if lora:
        set_adapters(policy)
    policy.train()
    examples = [trainer.train_dataset[i] for i in range(len(rows))]
    batch = trainer.data_collator(examples)
    if zero_reference:  # TRL's path for reference log-probabilities it was given: here all zeros
        trainer.precompute_ref_logps = True
        batch["ref_chosen_logps"] = batch["ref_rejected_logps"] = torch.zeros(len(rows))
    policy.zero_grad()
    value = trainer.compute_loss(policy, batch)
    value.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith("rewards/")}
    grads = {name(n): p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    return float(value), metrics, grads, examples


def name(parameter: str) -> str:
    return parameter.replace(".default.", ".")  # peft's adapter name, which only some paths keep


def our_side(cfg, model_dir, policy, reference, batch: PairBatch):
    net = Network(module=policy, fingerprint={}, flops_per_token=lambda s: 0.0, logits=hf_logits, vocab_size=10_000)
    objective = Preference(net, cfg, torch.device("cpu"))
    if reference is not None:
        with torch.no_grad():
            logps, _ = sequence_logps(hf_logits(reference, pair_rows(batch.inputs), None), pair_rows(batch.targets))
        batch = batch._replace(reference=logps.view(2, -1).T.contiguous())
    policy.zero_grad()
    value = objective.loss(policy, batch)
    value.backward()
    grads = {name(n): p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    return float(value), objective.flush(1), grads


def assert_same(ours, theirs, *, names):
    (loss, metrics, grads), (t_loss, t_metrics, t_grads) = ours, theirs
    assert loss == pytest.approx(t_loss, abs=1e-4), (loss, t_loss)
    assert metrics["chosen_reward"] == pytest.approx(t_metrics["rewards/chosen"], abs=1e-4)
    assert metrics["rejected_reward"] == pytest.approx(t_metrics["rewards/rejected"], abs=1e-4)
    assert metrics["reward_margin"] == pytest.approx(t_metrics["rewards/margins"], abs=1e-4)
    assert metrics["reward_accuracy"] == pytest.approx(t_metrics["rewards/accuracies"], abs=1e-4)
    assert sorted(grads) == sorted(t_grads) and len(grads) >= names, sorted(grads)[:4]
    for name, g in grads.items():
        torch.testing.assert_close(g, t_grads[name], atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "hinge"])
def test_loss_rewards_and_gradients_match_trl(claim, loss, lora):
    root, model_dir = claim
    beta = 0.5 if loss == "ipo" else 0.1
    cfg = config(root, model_dir, beta=beta, loss=loss)
    assert reference_kind(cfg) == "precomputed" and reference_kind(cfg.model_copy(update={"lora": {}})) == "adapters"
    if lora:
        cfg = TrainerConfig.model_validate({**cfg.model_dump(by_alias=True), "lora": {"r": 4}})
    batch = our_batch(root, model_dir, cfg)
    policy, reference = policy_and_reference(model_dir, lora)
    theirs = trl_side(model_dir, copy.deepcopy(policy), copy.deepcopy(reference), loss, beta)
    # The same records tokenized by TRL and by the trainer: the same rows, the answer's tokens trained.
    for k, example in enumerate(theirs[3]):
        for row, answer_ids in ((0, example["chosen_ids"]), (1, example["rejected_ids"])):
            ids = example["prompt_ids"] + answer_ids
            assert batch.inputs[k, row, : len(ids) - 1].tolist() == ids[:-1]
            trained = batch.targets[k, row][batch.targets[k, row] != IGNORE].tolist()
            assert trained == answer_ids
    ours = our_side(cfg, model_dir, policy, reference, batch)
    assert ours[0] > 0 and ours[1]["reward_margin"] != 0  # the policy is not its reference
    assert_same(ours, theirs[:3], names=8 if lora else 20)


def test_reference_free_and_label_smoothing_match_trl_by_their_definitions(claim):
    """Reference-free is TRL's loss given zero reference log-probabilities. Label smoothing e (conservative
    DPO) is (1 - e) of the loss on the pairs plus e of it on the pairs swapped, each TRL's sigmoid loss."""
    root, model_dir = claim
    policy, _ = policy_and_reference(model_dir, lora=True)
    cfg = TrainerConfig.model_validate(
        {**config(root, model_dir, referenceFree=True).model_dump(by_alias=True), "lora": {"r": 4}}
    )
    assert reference_kind(cfg) == "free"
    batch = our_batch(root, model_dir, cfg)
    ours = our_side(cfg, model_dir, copy.deepcopy(policy), None, batch)
    theirs = trl_side(model_dir, copy.deepcopy(policy), None, "sigmoid", 0.1, zero_reference=True)
    assert_same(ours, theirs[:3], names=8)

    e = 0.2
    cfg = TrainerConfig.model_validate(
        {**config(root, model_dir, labelSmoothing=e).model_dump(by_alias=True), "lora": {"r": 4}}
    )
    loss, _, grads = our_side(cfg, model_dir, copy.deepcopy(policy), None, our_batch(root, model_dir, cfg))
    kept = trl_side(model_dir, copy.deepcopy(policy), None, "sigmoid", 0.1)
    swapped = trl_side(model_dir, copy.deepcopy(policy), None, "sigmoid", 0.1, swap=True)
    assert loss == pytest.approx((1 - e) * kept[0] + e * swapped[0], abs=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g, (1 - e) * kept[2][name] + e * swapped[2][name], atol=1e-5, rtol=1e-4)
    assert abs(loss - kept[0]) > 1e-3  # smoothing changed it


def test_truncation_drops_the_prompt_first_then_the_answers_ends():
    # A 10-token prompt, answers of 3 and 6 tokens.
    assert preference.cut((10, 10), (13, 16), 20) == (0, 6)  # everything fits (16 <= 21)
    assert preference.cut((10, 10), (13, 16), 12) == (3, 6)  # the prompt keeps 7, the answers whole
    assert preference.cut((10, 10), (13, 16), 8) == (6, 5)  # the prompt keeps half the row; answers cut to 5
    assert preference.cut((3, 4), (8, 12), 6) == (1, 4)  # the rows' prompts differ by a merged token
    for prompts, lengths, seq in [((50, 50), (52, 90), 16), ((1, 1), (200, 300), 8), ((7, 6), (9, 9), 9)]:
        drop, keep = preference.cut(prompts, lengths, seq)
        assert keep >= 1 and all(p - drop + min(keep, n - p) <= seq + 1 for p, n in zip(prompts, lengths, strict=True))


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"prompt": "q", "chosen": "a"}, "`rejected` is missing"),
        ({"prompt": "q", "chosen": "  ", "rejected": "b"}, "`chosen` is empty"),
        ({"prompt": "q", "chosen": "a b", "rejected": "a b"}, "`chosen` and `rejected` are the same answer"),
        (
            {"prompt": "q", "chosen": {"role": "user", "content": "a"}, "rejected": "b"},
            "`chosen` as a message must be the assistant's",
        ),
        ({"prompt": "q", "chosen": 3, "rejected": "b"}, "`chosen` is a int"),
        ({"chosen": "a", "rejected": "b"}, "a preference record needs `prompt`"),
        ({"prompt": [{"role": "user"}], "chosen": "a", "rejected": "b"}, "every message of the prompt needs"),
    ],
)
def test_a_bad_record_fails_naming_its_line_or_is_skipped_and_counted(tmp_path, claim, record, message):
    _, model_dir = claim
    good = {"prompt": question(1), "chosen": answer(1), "rejected": answer(2)}
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n" + json.dumps(good) + "\n")
    data = config(tmp_path, model_dir).data
    with pytest.raises(DataError) as e:
        preference.build_cache(data, str(model_dir), tmp_path / "cache")
    assert f"{path}:2: {message}" in str(e.value) and "data.skipBadRecords" in str(e.value)
    meta = preference.build_cache(data.model_copy(update={"skip_bad_records": True}), str(model_dir), tmp_path / "c")
    assert meta["records"] == 2 and meta["skipped"] == 1 and meta["firstSkipped"] == f"{path}:2"


def test_sigmoid_loss_of_equal_policy_and_reference_is_log_two(claim):
    root, model_dir = claim
    cfg = config(root, model_dir)
    batch = our_batch(root, model_dir, cfg)
    _, reference = policy_and_reference(model_dir, lora=False)
    loss, metrics, _ = our_side(cfg, model_dir, reference.train(), copy.deepcopy(reference), batch)
    assert loss == pytest.approx(math.log(2), abs=1e-6) and metrics["reward_margin"] == pytest.approx(0, abs=1e-6)


def test_a_damaged_reference_file_on_the_claim_is_set_aside_and_never_trained_on(tmp_path, monkeypatch):
    """A precomputed reference is read back from the claim on every restart, so what is there is checked:
    sound parts are kept; a part of the wrong shape, with a NaN, or not a numpy file at all is renamed
    `*.damaged` (to be computed again), and so is a final file with an infinite value."""
    import numpy as np

    from sharded_trainer import objective

    monkeypatch.setattr(objective, "PART_RECORDS", 4)  # 10 records: parts of 4, 4 and 2
    parts = {name: np.zeros((n, 2)) for name, n in [("part-0000000000.npy", 4), ("part-0000000004.npy", 4)]}
    parts["part-0000000004.npy"][1, 0] = np.nan
    parts["part-0000000008.npy"] = np.zeros((3, 2))  # one row too many for the last part
    for name, array in parts.items():
        np.save(tmp_path / name, array)
    np.save(tmp_path / "part-0000000004.npy.writing-123.npy", np.zeros((4, 2)))  # a write cut short: no part
    sound, aside = objective.sound_reference_files(tmp_path, 10)
    assert sound == ["part-0000000000.npy"]
    assert [(p.name, reason) for p, reason in aside] == [
        ("part-0000000004.npy.damaged", "values that are not finite"),
        ("part-0000000008.npy.damaged", "(3, 2) values where (2, 2) belong"),
    ]
    assert sorted(p.name for p in tmp_path.glob("part-??????????.npy")) == ["part-0000000000.npy"]

    final = np.zeros((10, 2))
    final[9, 1] = -np.inf
    np.save(tmp_path / "logps.npy", final)
    assert objective.sound_reference_files(tmp_path, 10)[0] == []  # the parts are not read past a final file
    assert not (tmp_path / "logps.npy").exists() and (tmp_path / "logps.npy.damaged").is_file()
    (tmp_path / "part-0000000000.npy").write_bytes(b"half a write")
    [(path, reason)] = objective.sound_reference_files(tmp_path, 10)[1]
    assert path.name == "part-0000000000.npy.damaged" and reason.startswith("unreadable"), reason
    np.save(tmp_path / "logps.npy", np.ones((10, 2)))
    assert objective.sound_reference_files(tmp_path, 10) == (["logps.npy"], [])


def test_a_frozen_copy_casts_its_parameters_to_the_compute_dtype_and_keeps_its_buffers(claim):
    """objective.dpo.reference copy under bf16: every parameter bf16 and frozen, every buffer (the RoPE table)
    in the dtype a fresh build has, as mixed precision leaves the policy's (a bf16 RoPE table shifts the
    angles of late positions, and with them every reference log-probability)."""
    from sharded_trainer.modeling.build import build_network
    from sharded_trainer.objective import frozen_copy

    root, model = claim
    cfg = config(root, model).model_copy(update={"precision": "bf16"})
    fresh = dict(build_network(cfg).module.named_buffers())
    net, module = frozen_copy(cfg, lambda n: n.module)
    assert module is net.module and not module.training
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in module.parameters())
    buffers = dict(module.named_buffers())
    assert buffers and {k: b.dtype for k, b in buffers.items()} == {k: b.dtype for k, b in fresh.items()}
    assert any(b.dtype == torch.float32 for b in buffers.values())

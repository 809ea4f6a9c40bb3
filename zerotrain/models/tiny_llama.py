"""A small Llama-style Hugging Face model directory, built offline.

Used by ``examples/make_tiny_llama.py`` and by the tests (which build it once per test run):
a byte-level BPE tokenizer trained with ``tokenizers`` on the Python standard library's source
(:mod:`zerotrain.data.corpus`, always present, nothing downloaded), wrapped as a
``PreTrainedTokenizerFast`` with pad/eos tokens and a chat template, plus a randomly initialised
``LlamaForCausalLM``; both written with ``save_pretrained`` (safetensors, optionally sharded) so
``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained(path)`` read the directory back.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Optional, Union

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "build_tiny_tokenizer", "build_tiny_llama", "write_chat_jsonl"]

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

# `{% generation %}` marks the assistant's tokens, so `apply_chat_template(...,
# return_assistant_tokens_mask=True)` tells which tokens carry loss (transformers' own mechanism).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|end|>' }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' + '\n' }}{% endif %}"
)


def _corpus_chunks(max_bytes: int, chunk: int = 4096) -> Iterator[str]:
    from zerotrain.data.corpus import load_stdlib_corpus

    data = bytes(load_stdlib_corpus(max_bytes=max_bytes).tolist()).decode("utf-8", errors="replace")
    for start in range(0, len(data), chunk):
        yield data[start:start + chunk]


def build_tiny_tokenizer(vocab_size: int = 512, corpus_bytes: int = 1 << 20):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on the stdlib source (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(_corpus_chunks(corpus_bytes), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                  additional_special_tokens=SPECIAL_TOKENS[2:])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_llama(out_dir: Union[str, Path], *, vocab_size: int = 512, hidden_size: int = 64,
                     num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                     intermediate_size: int = 128, max_positions: int = 1024, seed: int = 0,
                     max_shard_size: Optional[str] = None, corpus_bytes: int = 1 << 20) -> Path:
    """Write tokenizer + random-init ``LlamaForCausalLM`` to ``out_dir`` with ``save_pretrained``.

    ``max_shard_size`` (e.g. ``"100KB"``) writes ``model-0000N-of-0000M.safetensors`` + index.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(vocab_size, corpus_bytes)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         intermediate_size=intermediate_size, max_position_embeddings=max_positions,
                         tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, use_cache=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    tok.save_pretrained(out)
    return out


def write_chat_jsonl(path: Union[str, Path], n: int = 64, seed: int = 0) -> Path:
    """A jsonl file of ``{"messages": [...]}`` conversations (toy arithmetic Q&A, deterministic)."""
    import random

    rng = random.Random(seed)
    path = Path(path)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(n):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            messages = [{"role": "user", "content": f"What is {a} + {b}?"},
                        {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]
            if rng.random() < 0.3:
                messages.insert(0, {"role": "system", "content": "You add numbers."})
            f.write(json.dumps({"messages": messages}) + "\n")
    return path

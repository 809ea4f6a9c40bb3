"""Shared pytest setup: make `tests/` importable so test modules share helpers."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A small Llama-style HF model directory (BPE tokenizer with a chat template + random-init
    LlamaForCausalLM, sharded safetensors), built once per test run by the same builder as
    examples/make_tiny_llama.py."""
    from zerotrain.models.tiny_llama import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), max_shard_size="200KB", corpus_bytes=256 << 10)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)

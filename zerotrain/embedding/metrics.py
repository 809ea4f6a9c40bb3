"""The metrics of `zerotrain train-embedding`: one record per optimizer step in the schema every zerotrain
run writes (`zerotrain.monitor.schema`, docs/metrics.md), written by the one training loop's writer
(`zerotrain.trainer.MetricsLog`: `LOG_DIR/metrics.jsonl` and the monitors the config enables, DeepSpeed's
`tensorboard`, `csv_monitor`, `wandb` blocks), so `zerotrain plot` and TensorBoard show an embedding run as
they show `zerotrain train`'s.

Training fields are the Trainer's (`loss` is the global contrastive batch's InfoNCE, per query;
`samples_per_s` is examples, i.e. queries, per second). The held-out retrieval evaluation adds
`recall_at_1`, `recall_at_10`, `mrr_at_10` to the record of the step it follows (the evaluation
before training is a record of step 0, samples 0, when the run starts from scratch).
"""
from __future__ import annotations

__all__ = ["RETRIEVAL_FIELDS"]

# `retrieval_metrics` keys -> the schema's field names (plain names: they become event and CSV file names)
RETRIEVAL_FIELDS = {"recall@1": "recall_at_1", "recall@10": "recall_at_10", "mrr@10": "mrr_at_10"}

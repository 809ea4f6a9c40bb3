"""`zerotrain.embedding`'s small parts in the pytest process (issue #48: the fast covering tests of their mutation
runs; the command's whole runs are tests/embedding/test_resume.py's)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


def test_each_retrieval_metric_is_recorded_under_its_own_schema_field():
    """The held-out evaluation's recall@1, recall@10 and MRR@10 become the metrics record's `recall_at_1`,
    `recall_at_10`, `mrr_at_10` (docs/metrics.md), each under its own name (three different values here)."""
    from zerotrain.embedding.metrics import RETRIEVAL_FIELDS
    from zerotrain.embedding.retrieval import retrieval_metrics

    passages = torch.eye(15)
    queries = torch.zeros(3, 15)
    queries[0, 0] = 1.0                      # ranked first
    queries[1, 1], queries[1, 5] = 0.5, 0.8  # second
    queries[2, 2], queries[2, 3:] = 0.1, 0.2  # 13th
    metrics = retrieval_metrics(F.normalize(queries, dim=-1), passages)
    record = {RETRIEVAL_FIELDS[k]: v for k, v in metrics.items() if k in RETRIEVAL_FIELDS}  # as the command's
    assert record == pytest.approx({"recall_at_1": 1 / 3, "recall_at_10": 2 / 3, "mrr_at_10": 0.5}, rel=1e-6)

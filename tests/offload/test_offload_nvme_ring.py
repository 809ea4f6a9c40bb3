"""NVMe offload's bounded swap file: one extent per chunk plus a ring of spare extents (no second copy).

With one spare extent per size class, a step outgrows the ring: buckets 1 and 2 share a size class, so the
first of them written is committed early (before the step ends) for the second to take its old extent. A
write failing after that, on both ranks or on rank 0 only, raises on every rank; each rank's uncommitted
chunks are exactly as before the step, the early-committed one exactly as after the clean step, and the
retry (same gradients) skips it and ends bit for bit where the run without a failure ends. The file holds each
chunk's record once plus the spares."""
from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

from distributed import run_distributed
from offload_common import build_engine, snapshot, train_steps, world_batches
from test_offload_nvme_failure import _failing_io

FAIL_STEP = 2


def train(nvme_path: str, failing_ranks: tuple) -> dict:
    import zerotrain.offload.aio as aio
    import zerotrain.offload.nvme_records as nvme_records
    from zerotrain.offload import OffloadIOError

    nvme_records.DEFAULT_SPARE_RECORDS = 1  # buckets 1 and 2 share a size class and its one spare
    engine = build_engine(2, {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 2})
    opt = engine.zero_optimizer
    records = opt.records
    out = {"file_bytes": records.disk_bytes(), "on_disk": os.path.getsize(os.path.join(records.directory,
                                                                                       "states.ring")),
           "record_bytes": sum(records.record_nbytes(c) for c in records.chunks),
           "spare_bytes": sum(records._class_layouts[k][1] for k in records.free)}
    original_step = engine._take_model_step

    def step():
        if engine.global_steps != FAIL_STEP or "after" in out:
            return original_step()
        out["before"] = snapshot(engine)
        if not failing_ranks:  # the clean run: its state after this step is what the early commit must hold
            original_step()
            out["after"] = snapshot(engine)
            return
        location = dict(records.location)
        # three record writes a step; the third finds its class's spare taken and commits the record of the
        # other bucket of its class early, then fails
        restore = _failing_io(aio, "_pwrite", 3, errno.EIO) if int(os.environ["RANK"]) in failing_ranks \
            else (lambda: None)
        try:
            with pytest.raises(OffloadIOError) as raised:
                original_step()
        finally:
            restore()
        out["message"] = str(raised.value)
        out["early"] = sorted(c.bucket for c in records.resume)
        out["moved"] = sorted(c.bucket for c in records.chunks if records.location[c] != location[c])
        out["after_failure"] = snapshot(engine)
        out["after"] = True
        original_step()  # the retry

    engine._take_model_step = step
    out["losses"], _ = train_steps(engine, world_batches(2))
    out["weights"] = engine.full_state_dict()
    out["stats"] = {k: v for k, v in opt.stats.items() if k.startswith("nvme")}
    opt.close()
    return out


def run_all(nvme_path: str) -> list:
    rank = os.environ["RANK"]
    return [train(os.path.join(nvme_path, f"r{rank}-{i}"), ranks) for i, ranks in enumerate(((), (0, 1), (0,)))]


def test_a_step_larger_than_the_ring_rolls_back_what_it_did_not_commit_and_resumes_exactly(tmp_path):
    per_rank = run_distributed(run_all, 2, str(tmp_path), timeout=120)
    for rank, (clean, both, one) in enumerate(per_rank):
        # the file: every chunk's record once plus one spare per size class, nothing more
        assert clean["on_disk"] == clean["file_bytes"] == clean["record_bytes"] + clean["spare_bytes"]
        assert clean["stats"]["nvme_early_commits"] > 0 and clean["stats"]["nvme_failed_steps"] == 0
        for failed, culprits in ((both, "[0, 1]"), (one, "[0]")):
            assert f"failed on rank(s) {culprits}" in failed["message"], failed["message"]
            early = failed["early"]
            assert len(early) == 1 and failed["moved"] == early, (rank, early, failed["moved"])
            mid, before, after = failed["after_failure"], failed["before"], clean["after"]
            for bucket in range(3):  # exactly as before where not committed, exactly as after the clean step else
                expected = after if bucket in early else before
                for kind in ("masters", "model"):
                    assert torch.equal(mid[kind][bucket], expected[kind][bucket]), (rank, culprits, kind, bucket)
                assert not torch.equal(before["masters"][bucket], after["masters"][bucket]), "the step changes it"
            assert failed["stats"]["nvme_failed_steps"] == 1 and failed["stats"]["nvme_resumed_chunks"] == 1
            assert failed["losses"] == clean["losses"], (rank, culprits)
            for name, ref in clean["weights"].items():
                assert torch.equal(failed["weights"][name], ref), (rank, culprits, name)


def _one_bucket_nvme_adamw(tmp_path, numel: int, chunk: int, **options) -> tuple:
    """One parameter of `numel` random values in one bucket of an NVMe offload optimizer (2 buffers of `chunk`
    elements), and torch's fused AdamW on a copy: (param, ref, ref_opt, opt)."""
    from zerotrain.offload import NvmeOffloadOptimizer
    from zerotrain.sharding import ShardGroup
    from zerotrain.zero.flat import FlatBucket

    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(numel))
    ref = torch.nn.Parameter(param.detach().clone())
    ref_opt = torch.optim.AdamW([ref], fused=True)
    opt = NvmeOffloadOptimizer([FlatBucket(0, [("w", param)], 0, ShardGroup.local())], None,
                               torch.optim.AdamW([param], fused=True), [[param]], 0.0, nvme_path=str(tmp_path),
                               buffer_count=2, chunk_numel=chunk, **options)
    return param, ref, ref_opt, opt


def test_the_file_is_the_records_once_plus_the_spares(tmp_path):
    """14 bytes per parameter at most on disk comes from here: 12 per element (fp32 master + Adam's two
    moments) once, chunks cut equally (no per-chunk padding beyond alignment), plus `spare` records."""
    numel, chunk, spare = 50_000, 4096, 2  # 13 chunks (12 of 4096, one of 848), one size class
    param, ref, ref_opt, opt = _one_bucket_nvme_adamw(tmp_path, numel, chunk, spare=spare)
    try:
        records = opt.records
        assert len(records.chunks) == 13 and {c.size_class for c in records.chunks} == {(0, chunk)}
        per_record = records.record_nbytes(records.chunks[0])
        # host memory: each of the 2 buffers is the largest record plus one fp32 chunk for its gradient
        assert records.pool.count == 2 and records.pool.nbytes == per_record + 4 * chunk
        assert records.disk_bytes() == (13 + spare) * per_record
        assert os.path.getsize(os.path.join(records.directory, "states.ring")) == records.disk_bytes()
        assert 13 * per_record <= 12 * numel * 1.1  # the records once: 12 B/element and a little alignment
        for _ in range(3):  # 13 chunks through 2 spares: early commits every step, still AdamW bit for bit
            grad = torch.randn(numel)
            ref.grad = grad.clone()
            ref_opt.step()
            opt.step([grad], 1.0)
            assert torch.equal(param.detach(), ref.detach())
        assert opt.stats["nvme_early_commits"] > 0
        assert len(set(records.location.values())) == 13 and sum(map(len, records.free.values())) == spare
    finally:
        opt.close()


def test_a_master_written_between_steps_is_where_the_next_step_starts(tmp_path):
    """A user's write to a stage-3 parameter between steps (`write_master`: nn.init on a running engine) goes into
    the on-disk records (read, master replaced, rewritten and committed) and replaces the records the last step
    kept in its buffers: the next steps are torch's AdamW continued from the written values with its moments,
    bit for bit; a bucket whose master is a tensor (not on disk) takes the values directly."""
    numel, chunk = 10_000, 4096  # 3 chunks
    param, ref, ref_opt, opt = _one_bucket_nvme_adamw(tmp_path, numel, chunk)
    try:
        for step in range(3):
            grad = torch.randn(numel)
            ref.grad = grad.clone()
            ref_opt.step()
            opt.step([grad], 1.0)
            assert torch.equal(param.detach(), ref.detach())
            if step == 0:
                assert opt.records.kept, "the last step kept records in its buffers"
                values = torch.randn(numel)
                with torch.no_grad():
                    ref.copy_(values)
                opt.write_master(0, values)
                assert not opt.records.kept
                with opt.resident_masters():
                    assert torch.equal(opt.masters[0], values)
    finally:
        opt.close()


def streamed(nvme_path: str) -> list:
    """Stage 3 without clipping or accumulation: gradients streamed to the NVMe step bucket by bucket, the same
    run with the gradients held until step() (streaming switched off), and a streamed run whose step 1 fails
    (a write on rank 0) and is retried by running the batch's forward/backward again. With clipping (1.0: it acts
    on steps 0 and 2, not on 1): the gradients spilled to the NVMe files during backward and read back by the
    step (`GradientSpill`), and the same run holding them in host memory until step() (the spill switched off)."""
    import zerotrain
    import zerotrain.offload.aio as aio
    import zerotrain.offload.nvme as factory
    from zerotrain.offload import OffloadIOError
    from offload_common import engine_config, param_groups
    from models_for_tests import OddMLP, micro_slice

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    import zerotrain.engine.parts as parts

    real, real_spill, real_narrow = factory.streams_gradients, factory.spills_gradients, parts.narrows_gradients
    out = []
    for case in ("streamed", "held", "failed", "bf16 streamed", "bf16 held", "clipped spilled", "clipped held",
                 "bf16 clipped spilled", "bf16 clipped held", "clipped failed", "cpu narrow", "cpu wide",
                 "bf16 clipped failed", "bf16 clipped first pass", "clipped first pass", "first pass failed"):
        if case.endswith("held"):
            factory.streams_gradients = lambda config, reducer: False
            factory.spills_gradients = lambda config, reducer: False
        if case == "cpu wide":  # plain CPU offload with the fp32 copies of the shards (before #43)
            parts.narrows_gradients = lambda config, reducer: False
        torch.manual_seed(0)
        model = OddMLP()
        config = dict(engine_config(3, {"device": "nvme", "nvme_path": os.path.join(nvme_path, case.replace(" ", "_")),
                                        "buffer_count": 2}), gradient_accumulation_steps=1,
                      gradient_clipping=1.0 if "clipped" in case or case.startswith("cpu") else 0.0,
                      train_micro_batch_size_per_gpu=4)
        if case.startswith("cpu"):  # plain CPU offload, bf16, clipping: the shards kept in bf16 (or fp32 copies)
            config["bf16"] = {"enabled": True}
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if case.startswith("bf16"):  # streamed, the reduced bf16 shards go to the step uncast (grads.py)
            config["bf16"] = {"enabled": True}
        if case.startswith("bf16") or "first pass" in case:
            # and the shards on NVMe too: the background step hands the new weights to the main thread's store
            config["zero_optimization"].update(stage3_param_persistence_threshold=0, offload_param={
                "device": "nvme", "nvme_path": os.path.join(nvme_path, case.replace(" ", "_") + "_params"),
                "buffer_count": 2, "max_in_cpu": 0})
        if case in ("bf16 clipped spilled", "bf16 clipped failed"):  # the spill, not the norm from a first pass
            config["zero_optimization"]["offload_optimizer"]["norm_first_pass"] = False
        if case == "first pass failed":
            config["gradient_clipping"] = 1.0
        engine, *_ = zerotrain.initialize(model=model, model_parameters=param_groups(model), config=config)
        factory.streams_gradients, factory.spills_gradients = real, real_spill
        parts.narrows_gradients = real_narrow
        held, losses, norms, raised, reads = [], [], [], [], []
        original = engine._take_model_step
        engine._take_model_step = lambda: (held.append(engine.reducer._gradient_bytes()), original())[1]
        for step, batch in enumerate(world_batches(2, steps=3)):
            x, y = micro_slice(batch, 0, rank, world, 4)
            if case.startswith(("bf16", "cpu")):
                x, y = x.bfloat16(), y.bfloat16()
            store_reads = (lambda: engine.param_store.io.bytes_read) if engine.param_store is not None else int
            for attempt in range(2):
                loss = engine(x, y)
                read_before_backward = store_reads()
                if case.endswith("failed") and step == 1 and attempt == 0:  # the writes run in backward
                    # clipped: the second gradient spilled fails, alone (the records' writes succeed)
                    spill = {engine.zero_optimizer.spill.fd} if case == "clipped failed" else None
                    if case == "bf16 clipped failed":  # a gradient spilled into its parameter's extent fails
                        spill = {engine.zero_optimizer.buckets[0].shard_extent().fd}
                    if case == "first pass failed":  # a record's write in the second pass (the store's succeed)
                        spill = {engine.zero_optimizer.records.fd}
                    restore = _failing_io(aio, "_pwrite", 2, errno.EIO, only_fds=spill, once=spill is not None) \
                        if rank == 0 else (lambda: None)
                    try:
                        engine.backward(loss)
                        # every spill write issued before step() (else step() may take the last shards from
                        # memory, and the failing write never happens)
                        engine.zero_optimizer.before_model_use()
                        with pytest.raises(OffloadIOError) as error:
                            engine.step()
                    finally:
                        restore()
                    raised.append(str(error.value))
                    continue  # the retry: forward and backward of the same batch again
                engine.backward(loss)
                engine.step()
                break
            losses.append(float(loss.detach()))
            norms.append(engine.get_global_grad_norm())
            reads.append(store_reads() - read_before_backward)  # the parameter store's reads in backward
        out.append({"losses": losses, "norms": norms, "held": held[-3:], "weights": engine.full_state_dict(),
                    "streams": getattr(engine.zero_optimizer, "stream_gradients", False), "raised": raised,
                    "spills": getattr(engine.zero_optimizer, "spill_gradients", False),
                    "slots": len(engine.zero_optimizer.spill.slots) if getattr(engine.zero_optimizer, "spill",
                                                                               None) else 0,
                    "buckets": len(engine.zero_optimizer.buckets),
                    "narrow": getattr(engine.zero_optimizer, "narrow_gradients", False),
                    "spill_host": engine.zero_optimizer.spill.host_bytes() if getattr(engine.zero_optimizer, "spill",
                                                                                      None) else 0,
                    "stream_budget": getattr(engine.zero_optimizer, "_stream_budget", 0),
                    "shard_bytes": 4 * sum(b.shard_numel for b in engine.zero_optimizer.buckets),
                    "stats": engine.offload_stats(), "param_reads": reads,
                    "records_io": (engine.zero_optimizer.records.io.bytes_read,
                                   engine.zero_optimizer.records.io.bytes_written) if case[:3] != "cpu" else None,
                    "first_pass": engine.zero_optimizer.takes_norm_first_pass(),
                    "param_store": engine.memory_report().get("offload_param")})
        engine.zero_optimizer.close()
    return out


def test_gradients_streamed_to_the_nvme_step_during_backward_change_nothing_but_memory(tmp_path):
    from offload_common import reference_training

    _, ref_weights = reference_training(world_batches(2, steps=3))
    results = run_distributed(streamed, 2, str(tmp_path), timeout=120)
    for on, off, failed, bf16_on, bf16_off, spilled, held, bf16_spilled, bf16_held, spill_failed, narrow, wide, \
            slot_failed, bf16_first, first, first_failed in results:
        # clipping with the parameters on NVMe ("auto"): the norm from a first backward over the retained graph,
        # the step streamed in the second with the clip fixed; the same bits as holding the gradients (bf16, fp32)
        # and as torch's clip_grad_norm_ + AdamW (fp32, below); the clip acts on steps 0 and 2, not on 1
        assert bf16_first["first_pass"] and first["first_pass"] and not bf16_spilled["first_pass"]
        assert not any(run["first_pass"] for run in (on, held, spilled, bf16_held))
        assert min(first["norms"]) < 1.0 < max(first["norms"]), first["norms"]
        for run, ref_run in ((bf16_first, bf16_held), (first, held), (first_failed, held)):
            assert run["losses"] == ref_run["losses"] and run["norms"] == ref_run["norms"]
            for name, ref in ref_run["weights"].items():
                assert torch.equal(run["weights"][name], ref), name
            assert run["stats"]["norm_first_passes"] == len(run["losses"]) + len(run["raised"])
            assert run["stats"]["norm_pass_mismatches"] == 0  # both passes' gradients the same, bit for bit
        assert set(first["weights"]) == (set(ref_weights) if first is results[0][14] else set())
        for name, weight in first["weights"].items():
            torch.testing.assert_close(weight, ref_weights[name], rtol=1e-5, atol=1e-6, msg=name)
        # a record's write failing on rank 0 in the second pass: every rank raises at step(), the batch again
        assert first_failed["raised"] and "failed on rank(s) [0]" in first_failed["raised"][0], first_failed["raised"]
        # no gradient on disk or held: no spill bytes, the records written as without clipping, the handed-over
        # bound as streaming's; the parameter store reads in backward at most twice the no-clip run's (one more
        # backward's reads; fewer once the recorded order keeps the parameters the second pass starts with), and
        # exactly twice at step 0 (nothing recorded yet)
        assert bf16_first["stats"]["nvme_spill_bytes"] == 0 and bf16_first["slots"] == 0
        assert bf16_first["records_io"][1] == bf16_on["records_io"][1]
        assert bf16_first["held"] == [0, 0, 0]
        assert bf16_first["stats"]["grad_host_peak_bytes"] == bf16_on["stats"]["grad_host_peak_bytes"]
        assert bf16_first["param_reads"][0] == 2 * bf16_on["param_reads"][0] > 0, bf16_first["param_reads"]
        assert all(b <= f <= 2 * b for f, b in zip(bf16_first["param_reads"], bf16_on["param_reads"])), \
            (bf16_first["param_reads"], bf16_on["param_reads"])
        # plain CPU offload, bf16, clipping: the shards kept in bf16 and cast as the kernel reads them, the same
        # bits as the fp32 copies, at half their bytes (plus one fp32 scratch of the largest shard)
        assert narrow["narrow"] and not wide["narrow"]
        assert narrow["losses"] == wide["losses"] and narrow["norms"] == wide["norms"] and max(narrow["norms"]) > 1
        for name, ref in wide["weights"].items():
            assert torch.equal(narrow["weights"][name], ref), name
        assert [2 * h for h in narrow["held"]] == wide["held"] and all(h > 0 for h in wide["held"]), \
            (narrow["held"], wide["held"])
        # a spill write failing on rank 0 in backward: every rank raises at step(), the batch's forward/backward
        # again, and the run ends where the one without a failure does
        assert spill_failed["raised"] and "failed on rank(s) [0]" in spill_failed["raised"][0], spill_failed["raised"]
        assert spill_failed["stats"]["nvme_failed_steps"] == 1
        assert spill_failed["losses"] == spilled["losses"] and spill_failed["norms"] == spilled["norms"]
        for name, ref in spilled["weights"].items():
            assert torch.equal(spill_failed["weights"][name], ref), name
        # bf16 with the parameters on NVMe: each reduced bf16 shard spilled as it is (2 bytes) into its own
        # parameter's extent (no spill file), cast to fp32 when read back
        assert bf16_spilled["spills"] and bf16_spilled["held"] == [0, 0, 0] and not bf16_held["spills"]
        assert bf16_spilled["slots"] == bf16_spilled["buckets"] > 0 and spilled["slots"] == 0
        assert bf16_spilled["stats"]["nvme_spill_bytes"] == 0 < spilled["stats"]["nvme_spill_bytes"]
        # a write into a parameter's extent failing on rank 0: every rank raises at step(), the lent extents get
        # their parameters back from the records, the batch's forward/backward again, the same run
        assert slot_failed["raised"] and "failed on rank(s) [0]" in slot_failed["raised"][0], slot_failed["raised"]
        assert slot_failed["stats"]["nvme_failed_steps"] == 1
        assert slot_failed["losses"] == bf16_spilled["losses"] and slot_failed["norms"] == bf16_spilled["norms"]
        for name, ref in bf16_spilled["weights"].items():
            assert torch.equal(slot_failed["weights"][name], ref), name
        assert bf16_spilled["losses"] == bf16_held["losses"] and bf16_spilled["norms"] == bf16_held["norms"]
        for name, ref in bf16_held["weights"].items():
            assert torch.equal(bf16_spilled["weights"][name], ref), name
        # clipping on: the spilled run equals the one holding its gradients, bit for bit, and torch's
        # clip_grad_norm_ + AdamW; the clip acts on some steps and not on others
        assert spilled["spills"] and not spilled["streams"] and not held["spills"] and not held["streams"]
        assert min(spilled["norms"]) < 1.0 < max(spilled["norms"]), spilled["norms"]
        assert spilled["losses"] == held["losses"] and spilled["norms"] == held["norms"]
        for name, ref in held["weights"].items():
            assert torch.equal(spilled["weights"][name], ref), name
        # (the losses here are each rank's own micro-batch's; the full weights are rank 0's)
        assert set(spilled["weights"]) == (set(ref_weights) if spilled is results[0][5] else set())
        for name, weight in spilled["weights"].items():
            torch.testing.assert_close(weight, ref_weights[name], rtol=1e-5, atol=1e-6, msg=name)
        # the gradients never sit whole in host memory: none held at step(), the counted peak within the
        # handed-over bound plus the spill's buffers; held: every shard at step()
        assert spilled["held"] == [0, 0, 0] and all(h > 0 for h in held["held"]), (spilled["held"], held["held"])
        peak = spilled["stats"]["grad_host_peak_bytes"]
        assert 0 < peak <= 4 * spilled["stream_budget"] + spilled["spill_host"], spilled["stats"]
        assert held["stats"]["grad_host_peak_bytes"] == held["shard_bytes"], held["stats"]
        assert spilled["stats"]["nvme_spill_bytes"] > 0 and held["stats"]["nvme_spill_bytes"] == 0
        assert on["streams"] and not off["streams"] and failed["streams"]
        assert bf16_on["streams"] and not bf16_off["streams"]
        assert bf16_on["param_store"]["nvme"] > 0 and bf16_off["param_store"]["nvme"] > 0 and on["param_store"] is None
        assert bf16_on["losses"] == bf16_off["losses"] and bf16_on["norms"] == bf16_off["norms"]
        assert bf16_on["losses"] != on["losses"], "the bf16 runs train in bf16"
        for name, ref in bf16_off["weights"].items():
            assert torch.equal(bf16_on["weights"][name], ref), name
        assert on["held"] == [0, 0, 0] and all(h > 0 for h in off["held"]), (on["held"], off["held"])
        assert on["losses"] == off["losses"] and on["norms"] == off["norms"]
        assert failed["raised"] and "failed on rank(s) [0]" in failed["raised"][0], failed["raised"]
        assert failed["stats"]["nvme_failed_steps"] == 1
        assert failed["losses"] == on["losses"] and failed["norms"] == on["norms"]
        for name, ref in off["weights"].items():
            assert torch.equal(on["weights"][name], ref), name
            assert torch.equal(failed["weights"][name], ref), name


class _TiedCheckpointed(torch.nn.Module):
    """An embedding tied to the head, a layer called twice (first inside a reentrant activation checkpoint, so its
    gradient arrives in two parts and its recompute gathers it in backward): the spill's hard cases. The 5120-element
    embedding is cut into two chunks (3072 + 2048 elements: in bf16 the second starts 2048 bytes past an alignment)
    and spilled in two pieces (4096 + 1024 elements)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(80, 64)
        self.mid = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 80, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        inner = lambda h: torch.tanh(self.mid(h))  # noqa: E731
        # under no_grad (a test's loss of the stored weights) the same values without the checkpoint, which warns there
        hidden = torch.utils.checkpoint.checkpoint(inner, self.emb(ids), use_reentrant=True) \
            if torch.is_grad_enabled() else inner(self.emb(ids))
        return self.head(torch.tanh(self.mid(hidden)))


def _batches(steps: int = 4):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 80, (4, 8), generator=generator), torch.randint(0, 80, (4, 8), generator=generator))
            for _ in range(steps)]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, 80), targets.reshape(-1))


CLIP_AT = 8.0


def _slot_run(tmp_path, name: str, dtype: torch.dtype, spill: bool, slow_spill: bool = False,
              first_pass: bool = False):
    """World 1, stage 3, parameters and optimizer on NVMe, clipping: `_TiedCheckpointed` in chunks of at most 4096
    elements. Its losses, norms, weights. `slow_spill`: each step's spill writes wait until `step()` has taken
    the shards not spilled yet (a disk slower than the backward), so the step gets every shard but the first
    from memory (three record buffers: the hand-over bound holds all three shards). `first_pass`: the default
    here ("auto": the norm from a first backward, then the clipped step streamed in the second); `spill`: the
    spill (`norm_first_pass: false`); neither: the gradients held until step()."""
    import zerotrain
    import zerotrain.offload.nvme as factory
    import zerotrain.offload.nvme_records as nvme_records

    torch.manual_seed(0)
    model = _TiedCheckpointed().to(dtype)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": CLIP_AT, "steps_per_print": 0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "bf16": {"enabled": dtype == torch.bfloat16},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / name),
                                                          "buffer_count": 3 if slow_spill else 2},
                                    "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / (name + "_p")),
                                                      "buffer_count": 2, "max_in_cpu": 0}}}
    if spill and not first_pass:
        config["zero_optimization"]["offload_optimizer"]["norm_first_pass"] = False
    real_spill, real_chunk = factory.spills_gradients, nvme_records.DEFAULT_CHUNK_NUMEL
    nvme_records.DEFAULT_CHUNK_NUMEL = 4096
    if not spill and not first_pass:
        factory.spills_gradients = lambda config, frees: False
    try:
        engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=config)
    finally:
        factory.spills_gradients, nvme_records.DEFAULT_CHUNK_NUMEL = real_spill, real_chunk
    opt = engine.zero_optimizer
    release = threading.Event()
    if slow_spill:
        real_write, real_keep = opt.spill.write_shard, opt._keep_unspilled

        def write_shard(bucket, grad):
            release.wait(timeout=60)
            return real_write(bucket, grad)

        def keep():
            kept = real_keep()
            release.set()
            return kept

        opt.spill.write_shard, opt._keep_unspilled = write_shard, keep
    losses, norms = [], []
    for ids, targets in _batches():
        loss = _loss(engine(ids), targets)
        engine.backward(loss)
        engine.step()
        release.clear()
        losses.append(float(loss.detach()))
        norms.append(engine.get_global_grad_norm())
    release.set()  # from here on the spill writes go at once
    out = {"losses": losses, "norms": norms, "weights": engine.full_state_dict(), "stats": engine.offload_stats(),
           "slots": set(opt.spill.slots) if opt.spill is not None else set(), "buckets": len(opt.buckets),
           "chunks": len(opt.records.chunks), "shard_numels": [b.shard_numel for b in opt.buckets],
           "first_pass": opt.takes_norm_first_pass(), "gather": engine.work_stats()["gather"]}
    if spill and not first_pass:  # the model used between backward and step: one clear line, not the gradient read as weights
        engine.backward(_loss(engine(ids), targets))
        with pytest.raises(RuntimeError, match=r"extent holds its gradient.*engine.step\(\)"):
            engine(ids)
    opt.close()
    return out


def test_gradients_spilled_into_the_parameters_own_extents_equal_torch_and_take_no_disk(tmp_path, world_of_one):
    """Clipping with parameters on NVMe: each final gradient shard goes into its parameter's extent (lent by the
    store until the step writes the new values), so no spill file, with a tied head and a reentrant checkpoint's
    recompute; fp32 equals torch's clip_grad_norm_ + AdamW, the clip acting on some steps and not others; bf16
    (unaligned chunk starts) equals the held gradients bit for bit."""
    torch.manual_seed(0)
    ref = _TiedCheckpointed()
    optimizer = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    ref_losses, ref_norms = [], []
    for ids, targets in _batches():
        loss = _loss(ref(ids), targets)
        loss.backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP_AT)))
        optimizer.step()
        optimizer.zero_grad()
        ref_losses.append(float(loss.detach()))
    assert min(ref_norms) < CLIP_AT < max(ref_norms), ref_norms  # the clip acts on some steps, not on others
    fp32 = _slot_run(tmp_path, "fp32", torch.float32, spill=True)
    assert fp32["slots"] == set(range(fp32["buckets"])) and fp32["buckets"] == 3 and fp32["chunks"] == 4
    assert fp32["stats"]["nvme_spill_bytes"] == 0
    assert max(abs(a - b) / b for a, b in zip(fp32["losses"], ref_losses)) <= 1e-5
    assert max(abs(a - b) / b for a, b in zip(fp32["norms"], ref_norms)) <= 1e-5
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(fp32["weights"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    spilled = _slot_run(tmp_path, "bf16", torch.bfloat16, spill=True)
    held = _slot_run(tmp_path, "bf16_held", torch.bfloat16, spill=False)
    assert spilled["slots"] == {0, 1, 2} and not held["slots"]
    assert spilled["losses"] == held["losses"] and spilled["norms"] == held["norms"]
    for name, value in held["weights"].items():
        assert torch.equal(spilled["weights"][name], value), name
    # the same records written; on top, each step's gradients once into the parameters' extents (aligned), but
    # for the last shards handed over that the step took from memory before their spill started
    extents = sum(-(-2 * numel // 4096) * 4096 for numel in spilled["shard_numels"])
    assert spilled["stats"]["nvme_bytes_written"] - held["stats"]["nvme_bytes_written"] == \
        4 * extents - spilled["stats"]["nvme_spill_skipped_bytes"]
    # a disk slower than the backward: every shard but the first handed over stays in memory for the step, is
    # neither written nor read back, and the step is the same, bit for bit
    slow = _slot_run(tmp_path, "bf16_slow", torch.bfloat16, spill=True, slow_spill=True)
    assert slow["losses"] == held["losses"] and slow["norms"] == held["norms"]
    for name, value in held["weights"].items():
        assert torch.equal(slow["weights"][name], value), name
    kept = slow["stats"]["grad_kept_in_memory"]
    assert 0 < kept < 4 * sum(slow["shard_numels"]), slow["stats"]
    assert slow["stats"]["nvme_spill_skipped_bytes"] > 0
    assert slow["stats"]["nvme_bytes_written"] - held["stats"]["nvme_bytes_written"] == \
        4 * extents - slow["stats"]["nvme_spill_skipped_bytes"]
    assert slow["stats"]["nvme_bytes_read"] < spilled["stats"]["nvme_bytes_read"], (slow["stats"], spilled["stats"])
    # the norm from a first backward over the retained graph (the default with the parameters on NVMe: "auto"),
    # through the reentrant checkpoint's recompute and the tied head: fp32 equals torch, bf16 the held gradients
    # bit for bit (the same terms in both passes), and no gradient byte is written anywhere (the held run's bytes)
    fp32_first = _slot_run(tmp_path, "fp32_first", torch.float32, spill=False, first_pass=True)
    bf16_first = _slot_run(tmp_path, "bf16_first", torch.bfloat16, spill=False, first_pass=True)
    assert fp32_first["first_pass"] and bf16_first["first_pass"] and not (held["first_pass"] or spilled["first_pass"])
    assert fp32_first["losses"] == fp32["losses"] and fp32_first["norms"] == fp32["norms"]
    for name, value in fp32["weights"].items():
        assert torch.equal(fp32_first["weights"][name], value), name
    assert bf16_first["losses"] == held["losses"] and bf16_first["norms"] == held["norms"]
    for name, value in held["weights"].items():
        assert torch.equal(bf16_first["weights"][name], value), name
    for run in (fp32_first, bf16_first):
        assert run["stats"]["norm_first_passes"] == 4 and run["stats"]["norm_pass_mismatches"] == 0, run["stats"]
        assert run["stats"]["nvme_spill_bytes"] == 0 and not run["slots"]
    assert bf16_first["stats"]["nvme_bytes_written"] == held["stats"]["nvme_bytes_written"]
    # stage 3's fetch record holds both passes: every step follows it (no mismatch), and prefetch stays within the
    # one request ahead it keeps in a single backward
    for run in (fp32_first, bf16_first):
        assert run["gather"]["order_mismatches"] == 0 == held["gather"]["order_mismatches"], run["gather"]
        assert run["gather"]["peak_prefetch_inflight_numel"] <= held["gather"]["peak_prefetch_inflight_numel"] and \
            run["gather"]["peak_live_inflight_numel"] <= held["gather"]["peak_live_inflight_numel"], \
            (run["gather"], held["gather"])


def test_a_failed_streamed_step_is_undone_in_the_model_before_it_returns_and_rewrites_only_what_it_wrote(
        tmp_path, world_of_one):
    """World 1, stage 3, parameters and optimizer on NVMe, no clipping: the gradients are streamed to the step in
    backward and each bucket's new weights written into its parameter store then. A record's write failing (step 2):
    when step() raises, the stores already hold the weights before the step again (the module called directly, not
    through the engine, computes the loss of those weights), every chunk written is put back. The first record read
    failing (step 3): nothing was stepped, so nothing is put back and the stores are not written at all. The retried
    steps (the same batch's forward and backward again) end where torch's AdamW does."""
    import errno

    import zerotrain
    import zerotrain.offload.aio as aio
    import zerotrain.offload.nvme_records as nvme_records
    from zerotrain.offload import OffloadIOError

    batches = _batches(5)
    torch.manual_seed(0)
    ref = _TiedCheckpointed()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    ref_losses = []
    for ids, targets in batches:
        loss = _loss(ref(ids), targets)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(loss.detach()))
    torch.manual_seed(0)
    model = _TiedCheckpointed()
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "steps_per_print": 0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "o"),
                                                          "buffer_count": 2},
                                    "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "p"),
                                                      "buffer_count": 2, "max_in_cpu": 0}}}
    real_chunk, nvme_records.DEFAULT_CHUNK_NUMEL = nvme_records.DEFAULT_CHUNK_NUMEL, 4096
    try:
        engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=config)
    finally:
        nvme_records.DEFAULT_CHUNK_NUMEL = real_chunk
    opt = engine.zero_optimizer
    try:
        assert opt.stream_gradients and len(opt.records.chunks) == 4
        losses = []
        for step, (ids, targets) in enumerate(batches):
            loss = _loss(engine(ids), targets)
            if step in (2, 3):
                restored, store_written = opt.stats["nvme_restored_chunks"], engine.param_store.io.bytes_written
                # step 2: the second record write fails (after every bucket was stepped and stored);
                # step 3: the first record read fails (no bucket is stepped)
                fail = _failing_io(aio, "_pwrite" if step == 2 else "_pread", 2 if step == 2 else 1, errno.EIO,
                                   only_fds={opt.records.fd}, once=True)
                try:
                    engine.backward(loss)
                    with pytest.raises(OffloadIOError, match="writing" if step == 2 else "reading"):
                        engine.step()
                finally:
                    fail()
                with torch.no_grad():
                    assert float(_loss(engine.module(ids), targets)) == float(loss), "the failed step's weights"
                if step == 2:
                    assert opt.stats["nvme_restored_chunks"] - restored == 4
                else:
                    assert opt.stats["nvme_restored_chunks"] == restored
                    assert engine.param_store.io.bytes_written == store_written, "a store written for nothing"
                loss = _loss(engine(ids), targets)  # the retry
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        assert opt.stats["nvme_failed_steps"] == 2
        # the I/O counted is the records' file's (no spill here), reads and writes each under its own name
        io = opt.records.io
        assert (opt.stats["nvme_bytes_read"], opt.stats["nvme_bytes_written"]) == (io.bytes_read, io.bytes_written)
        assert 0 < io.bytes_read != io.bytes_written, (io.bytes_read, io.bytes_written)
        assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) <= 1e-5, (losses, ref_losses)
    finally:
        opt.close()

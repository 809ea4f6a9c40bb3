"""Mutation testing of one module of zerotrain: do its tests fail when its code is wrong?

    python -m tools.mutate zerotrain/zero/gradnorm.py [--sample N --seed S] [--tests T ...] [--list]

Each mutant is one small plausible bug (a flipped comparison, a dropped factor or term, an off-by-one
constant, a dropped call, a removed `abs`, swapped arguments, ...) made from the file's `ast`. The tool
writes it into the file ON DISK, runs the tests that cover the module (pytest in a subprocess, stopping at
the first failure) and restores the file. Most of zerotrain runs inside spawned ranks: a tool that decides
coverage in its own process (mutmut) sees that code as untested; a file on disk is what the ranks import.

Why our own ~400 lines and not cosmic-ray (which also mutates on disk and runs a command): its operators
are generic (every int literal and keyword, many equivalent mutants per line), it needs a session database
and a config per module, and it has no notion of "the tests that cover this module"; here the operators
are the bugs this project has actually shipped or planted (see docs/testing.md), the covering tests come
from a table (`COVERING`) or from the tests' imports, and it needs nothing beyond pytest.

The file is restored always: on success, failure, Ctrl-C or SIGTERM (a finally block), and a copy of the
original sits at FILE.mutate-orig while a mutant is on disk, which the next run puts back first if a run
was killed -9 (a FILE.mutate-pid names the live run: another run, or --list, never takes the file from
it). Children run with PYTHONDONTWRITEBYTECODE and the original's mtime is restored, so no
stale bytecode of a mutant survives. A mutant's test run has a time limit (3x the unmutated run, at least
60 s): a mutant that hangs counts as killed (`timeout`); `ZEROTRAIN_TEST_RUN_TIMEOUT` caps every
`run_distributed` launch at that limit so that a hung collective fails the test instead of the whole run.

Survivors print as FILE:LINE, the mutant id, the operator and a diff. An id listed in
tools/mutation_equivalents.txt (`ID  FILE  reason`) is an equivalent mutant: it is not run, and not counted.
"""
from __future__ import annotations

import argparse
import ast
import difflib
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENTS = ROOT / "tools" / "mutation_equivalents.txt"
BACKUP_SUFFIX = ".mutate-orig"
LOCK_SUFFIX = ".mutate-pid"

# module -> the tests that cover it and run in minutes (not every test that reaches it: those are the suite).
# Modules not listed get the test files that import them (`covering_tests`).
COVERING: dict[str, list[str]] = {
    # fp32 data parallel; tensor-parallel ranks != 0 (split ranges); fp16's overflow agreement
    "zerotrain/zero/gradnorm.py": ["tests/zero/test_parity.py",
                                   "tests/parallel/test_tensor_parallel_engine.py::test_tensor_parallel_only",
                                   "tests/zero/test_precision_and_memory.py::test_fp16_overflow_skips_step_on_every_rank",
                                   "tests/parallel/test_moe_engine.py"],
    # in-process units first (the staging pool, qgZ's per-bucket reducers and LoCo bookkeeping), then the engine:
    # exact stages 0-2, stage 3's reuse, qgZ + LoCo through the reducer, the held-gradient accounting
    "zerotrain/zero/grads.py": ["tests/zero/test_grads_units.py", "tests/zero/test_parity.py",
                                "tests/zero/test_stage3_grads_reuse.py",
                                "tests/zero/test_zeropp_training.py::test_loco_reset_save_load_rescale_and_overflow",
                                "tests/zero/test_precision_and_memory.py::test_memory_accounting_world_4"],
    "zerotrain/zero/reduce.py": ["tests/zero/test_grads_units.py",
                                 "tests/zero/test_zeropp_training.py::test_loco_reset_save_load_rescale_and_overflow",
                                 "tests/zero/test_parity.py"],
    "zerotrain/zero/optimizer.py": ["tests/zero/test_optimizer_units.py", "tests/test_loss_scaler.py",
                                    "tests/zero/test_parity.py"],
    # in-process first (an Init-time slice's metadata, no fp32 master copy; then Init's writes and initializers at
    # world 2); parity at world 2 (also: released between steps, counters from zero); state_dict() inside
    # GatheredParameters
    "zerotrain/zero/stage3/partition.py": ["tests/zero/test_stage3_init_ops.py",
                                           # a shard handed to an offload_param store and back (in-process)
                                           "tests/offload/test_offload_units.py::test_param_store_grows_one_shard_at_a_time_as_zero_init_hands_them_in",
                                           "tests/zero/test_stage3.py::test_stage3_matches_single_process[2]",
                                           "tests/zero/test_stage3_init.py::test_init_holds_only_shards_and_gathers_the_plain_model",
                                           "tests/test_deepspeed_programs.py::test_stage3_saves_of_real_programs_and_from_pretrained"],
    # in-process micro-steps at a world of one first (releases after no-grad and generate forwards, peaks from
    # below, the "gather" phase, a parameter prefetch passed over kept); then parity at worlds 1, 2, 4 (released
    # between steps, counters from zero), reuse kept, prefetch budgets
    "zerotrain/zero/stage3/fetch.py": ["tests/zero/test_stage3_fetch_units.py", "tests/zero/test_stage3.py",
                                       "tests/zero/test_stage3_grads_reuse.py",
                                       "tests/zero/test_stage3_prefetch_budget.py",
                                       # qwZ over split experts' expert-data-parallel pairs
                                       "tests/parallel/test_moe_zeropp.py::test_stage3_qwz_and_hpz_with_split_experts[4-2]",
                                       # a bucketed gather's peak bytes at world 2 (the staged input: 1/N)
                                       "tests/zero/test_stage3_memory.py::test_sequential_gather_peak_is_one_parameter"],
    # in-process grouping first; then parity at worlds 2 and 4 (a padded parameter's last row; a gradient arriving
    # twice in one backward: the reentrant combo), bucket counts, the held tensors between micro-steps
    "zerotrain/zero/stage3/grads.py": ["tests/zero/test_stage3_grads_units.py",
                                       "tests/zero/test_stage3.py::test_stage3_matches_single_process[2]",
                                       "tests/zero/test_stage3.py::test_stage3_matches_single_process[4]",
                                       "tests/zero/test_stage3_grads_reuse.py",
                                       "tests/zero/test_stage3_memory.py::test_quarter_of_gradients_held_between_micro_steps_at_world_4"],
    # in-process: releases after forward and after the gradient, saved parameters and views (world 1)
    "zerotrain/zero/stage3/hooks.py": ["tests/zero/test_stage3_fetch_units.py",
                                       "tests/test_engine_world_of_one.py::test_a_finished_engine_is_collected_with_its_communicator",
                                       "tests/test_engine_world_of_one.py::test_stage3_keeps_a_parameter_its_module_still_uses_when_a_child_sharing_it_ends",
                                       # issue #43: the saved activations the first pass's reserve holds back
                                       "tests/test_budget.py::test_the_first_pass_keeps_its_activations_out_of_the_parameter_cache"],
    # the hooks reduce (grads units) and do not keep a finished engine alive (world of one, stages 1-3)
    "zerotrain/zero/param_hooks.py": ["tests/zero/test_grads_units.py",
                                      "tests/test_engine_world_of_one.py::test_a_finished_engine_is_collected_with_its_communicator"],
    "zerotrain/zero/stage3/trace.py": ["tests/zero/test_stage3_trace_units.py", "tests/zero/test_stage3_fetch_units.py"],
    "zerotrain/zero/stage3/buffers.py": ["tests/zero/test_stage3_buffers.py", "tests/zero/test_stage3_fetch_units.py"],
    # the engine's stage-3 setup: parity at world 2 (ranks built with other values, zero.Init, persistent and frozen
    # parameters), then what a rank holds at world 4
    "zerotrain/zero/stage3/setup.py": ["tests/zero/test_stage3_fetch_units.py", "tests/zero/test_stage3_owner.py",
                                       "tests/zero/test_stage3.py::test_stage3_matches_single_process[2]",
                                       "tests/zero/test_stage3_memory.py::test_persistent_parameters_stay_whole",
                                       "tests/zero/test_stage3_memory.py::test_stage3_holds_a_quarter_at_world_4",
                                       # staging peaks: the trainable parts reversed into backward order
                                       "tests/zero/test_stage3_memory.py::test_gradient_shards_held_only_while_accumulating",
                                       "tests/parallel/test_moe_zeropp.py::test_stage3_qwz_and_hpz_with_split_experts[4-2]"],
    # in-process: the masters the owner hands out and writes (bf16 parts, a real ShardedOptimizer); offload's store
    "zerotrain/zero/stage3/owner.py": ["tests/zero/test_stage3_owner.py", "tests/offload/test_offload_units.py"],
    # in-process layout (three partitions, the packing limit), then stages 0-2 at world 2
    "zerotrain/zero/flat.py": ["tests/zero/test_flat.py", "tests/zero/test_optimizer_units.py",
                               "tests/zero/test_parity.py::test_stages_match_single_process[2]"],
    # in-process: every function and branch of quant.py (its collectives are compressed.py's, tested there)
    "zerotrain/comm/quant.py": ["tests/comm/test_quant_props.py"],
    "zerotrain/comm/compressed.py": ["tests/comm/test_error_feedback.py", "tests/comm/test_qgz_collectives.py",
                                     "tests/comm/test_loco_bounded.py"],
    "zerotrain/offload/cpu_adam.py": ["tests/offload/test_cpu_adam.py"],  # in-process: kernel, build cache, threads
    # in-process: the ring file and the streamed chunks; spawned: rollback of a step larger than the ring
    "zerotrain/offload/nvme_records.py": [
        "tests/offload/test_offload_nvme_ring.py::test_the_file_is_the_records_once_plus_the_spares",
        "tests/offload/test_offload_units.py::test_streamed_chunks_equal_fused_adamw_bitwise",
        "tests/offload/test_offload_nvme_bf16.py",  # bf16 records: stochastic rounding into them
        "tests/offload/test_offload_nvme_masters.py::test_masters_live_in_the_files_and_match_torch_bitwise",
        "tests/offload/test_offload_nvme_ring.py"],
    # in-process first: start-up (a failed first write), the torch step for an optimizer the kernel does not take,
    # the bf16 records, a failed streamed step at a world of one; then the ring file's world-2 launches
    "zerotrain/offload/nvme.py": [
        "tests/offload/test_offload_units.py", "tests/offload/test_offload_nvme_masters.py",
        "tests/offload/test_offload_nvme_bf16.py", "tests/offload/test_offload_nvme_ring.py"],
    # in-process: both rounding paths and the seeds (test_offload_nvme_bf16.py's own functions)
    "zerotrain/offload/stochastic_round.py": ["tests/offload/test_offload_nvme_bf16.py"],
    "zerotrain/offload/bf16_host.py": [
        "tests/offload/test_offload_nvme_bf16.py::test_cpu_offload_bf16_masters_step_as_torch_then_round_and_take_six_bytes"],
    # in-process: blocks in flight, short reads and writes, the files' mode, the O_DIRECT probe, I/O errors
    "zerotrain/offload/aio.py": ["tests/offload/test_offload_units.py"],
    # in-process: the store's growth, reuse, reads ahead and a resident write back; then offload_param at world 2
    "zerotrain/offload/param_store.py": [
        "tests/offload/test_offload_units.py::test_param_store_grows_one_shard_at_a_time_as_zero_init_hands_them_in",
        "tests/offload/test_offload_units.py::test_param_store_reuses_freed_extents_and_compacts_to_the_live_shards",
        "tests/offload/test_offload_units.py::test_param_store_merges_a_freed_extent_with_the_hole_before_it_not_the_first",
        "tests/offload/test_offload_units.py::test_build_param_store_builds_what_offload_param_asks_for",
        # issue #43: the cache held back for the first pass's activations (in-process)
        "tests/offload/test_offload_units.py::test_param_store_holds_back_cache_for_memory_held_elsewhere",
        "tests/test_budget.py::test_the_first_pass_keeps_its_activations_out_of_the_parameter_cache",
        "tests/offload/test_offload_param.py",
        # the extents lent to clipping's gradient spill (in-process)
        "tests/offload/test_offload_nvme_ring.py::test_gradients_spilled_into_the_parameters_own_extents_equal_torch_and_take_no_disk"],
    # in-process units (a partial ratio's accounting, clipping near the epsilon), then parity and fp16 overflow
    "zerotrain/offload/cpu_optimizer.py": [
        "tests/offload/test_offload_units.py",
        "tests/offload/test_cpu_adam.py::test_offload_update_runs_the_kernel_and_keeps_the_reduced_gradient",
        "tests/offload/test_offload_nvme_bf16.py", "tests/offload/test_offload_parity.py",
        "tests/offload/test_offload_overflow.py::test_fp16_overflow_rolls_back_speculation_exactly[2]"],
    # in-process: PlacedWriter runs and join_runs (#50); world 2: in-place writes into several files, a failed
    # commit; out of space; one rank's failure named (async); TP slices joined; LoCo files; bf16's master files
    "zerotrain/checkpoint/write.py": [
        "tests/checkpoint/test_ckpt_units.py",
        "tests/checkpoint/test_ckpt_world_of_one.py",  # saves at a world of one: state, RNG, failures
        "tests/checkpoint/test_ckpt_write.py", "tests/checkpoint/test_ckpt_disk_full.py",
        "tests/checkpoint/test_ckpt_async.py::test_async_save_overlaps_training_and_surfaces_errors",
        "tests/checkpoint/test_ckpt_tensor_parallel.py::test_tp2_checkpoint_holds_whole_tensors_and_resumes_at_tp1",
        "tests/zero/test_loco_resume.py",
        "tests/checkpoint/test_ckpt_resume.py::test_resume_across_world_sizes_and_stages[bf16-w2s3-w4s1-w1s0]"],
    "zerotrain/schedules.py": ["tests/test_schedules.py"],
    "zerotrain/precision.py": ["tests/test_loss_scaler.py", "tests/zero/test_precision_and_memory.py"],
    "zerotrain/lora.py": ["tests/merge/test_merge.py"],
    "zerotrain/merge/methods.py": ["tests/merge/test_methods.py", "tests/merge/test_merge.py"],
    "zerotrain/embedding/loss.py": ["tests/embedding/test_loss.py",  # rank > 0's labels: negatives across ranks
                                    "tests/embedding/test_gradcache.py::test_negatives_across_ranks_world2_all_stages"],
    "zerotrain/embedding/gradcache.py": ["tests/embedding/test_gradcache.py"],
    "zerotrain/data/packing.py": ["tests/data/test_local_data.py"],  # test_corpus.py never imports packing
    "zerotrain/data/sampler.py": ["tests/data/test_sampler.py"],
    # in-process formats, cache and packing inputs; the spawned file: the rank-0 builder thread and its barrier
    "zerotrain/data/tokenization.py": ["tests/data/test_local_data.py", "tests/data/test_data_distributed.py"],
    "zerotrain/trainer.py": ["tests/test_cli.py"],
    # the run layer's config (in-process: RunConfig, train_config at a pipeline, a one-rank train run)
    "zerotrain/run/config.py": ["tests/test_run.py", "tests/test_train_flags.py"],
    # generate on the run layer: forward_only_config in-process, the command in-process, the world-2 NVMe engine
    "zerotrain/run/generate.py": [
        "tests/test_inference.py::test_forward_only_config_drops_the_training_blocks_and_keeps_or_makes_a_batch",
        "tests/test_inference.py::test_generate_command_prints_the_greedy_continuation",
        "tests/test_inference.py::test_zero3_nvme_generate_matches_transformers_on_every_rank"],
    # the manifest and the checksums in-process; a damaged checkpoint refused at world 2
    "zerotrain/checkpoint/integrity.py": [
        # round 7: balanced shares at worlds 1-3 (in-process, seconds)
        "tests/checkpoint/test_ckpt_read_units.py::test_balanced_shares_cover_every_byte_once_and_level_the_ranks_at_worlds_1_2_3",
        "tests/checkpoint/test_ckpt_units.py", "tests/checkpoint/test_ckpt_corruption.py"],
    # range reads; a tensor-parallel slice read in runs from the whole tensor (in-process); round 7: the page cache
    # after a prefetch, refusals of ranges and destinations, the load's reads into shards and new states
    # issue #48 round 7: the presets, the byte tokenizer, LoRA's refusals, a bare-named directory's resize (in-process),
    # then the missing files and a directory's load at a world of one (test_hf.py's others are world-2 launches)
    "zerotrain/models/hf.py": ["tests/models/test_hf_units.py",
                               "tests/models/test_hf.py::test_missing_or_incomplete_model_directories_are_named",
                               "tests/models/test_hf.py::test_workers_get_the_model_and_data_arguments",
                               "tests/test_run_model_units.py"],
    "zerotrain/checkpoint/reader.py": [
        "tests/checkpoint/test_ckpt_read_units.py", "tests/checkpoint/test_ckpt_load_units.py",
        "tests/checkpoint/test_ckpt_units.py",
        "tests/checkpoint/test_ckpt_tensor_parallel.py::test_a_local_range_of_a_split_tensor_reads_from_the_whole_tensor"],
    # in-process: a world-of-one save (fp32, fp16) exported at stages 2-3, worlds 2-3, read by DeepSpeed's
    # zero_to_fp32 and imported back bit for bit (test_ckpt_deepspeed.py's DeepSpeed resumes take minutes)
    "zerotrain/checkpoint/deepspeed_export.py": ["tests/checkpoint/test_ckpt_deepspeed_units.py"],
    "zerotrain/checkpoint/deepspeed_dir.py": ["tests/checkpoint/test_ckpt_deepspeed_units.py"],
    # one world-8 launch: every group of a pp2 x sp2 x tp2 grid, ZeRO++ and expert subgroups, refusals; the
    # environment's ranks per node and the node layout in-process
    "zerotrain/topology.py": ["tests/test_topology.py"],
    # in-process first (a reused pid, a release after a restart's re-entry), then real holders in their own processes
    "zerotrain/checkpoint/lock.py": [
        "tests/checkpoint/test_ckpt_lock.py::test_a_reused_pid_is_told_apart_by_its_start_time",
        "tests/checkpoint/test_ckpt_lock.py::test_release_leaves_a_lock_another_process_of_the_job_took_over",
        "tests/checkpoint/test_ckpt_lock.py::test_a_lock_of_another_users_process_is_never_taken_over",
        "tests/checkpoint/test_ckpt_lock.py::test_a_second_job_is_refused_naming_the_holder_and_a_stale_lock_is_taken_over",
        "tests/checkpoint/test_ckpt_lock.py::test_lock_from_another_host_is_never_guessed_stale"],
    "zerotrain/checkpoint/fence.py": ["tests/checkpoint/test_ckpt_fence.py"],  # in-process threads, seconds
    # issue #48 round 4 (checkpoint internals): in-process first; the world-2 async test names a failing rank
    "zerotrain/checkpoint/commit.py": ["tests/checkpoint/test_ckpt_commit_units.py", "tests/checkpoint/test_ckpt_units.py"],
    "zerotrain/checkpoint/checkpointer.py": [
        "tests/checkpoint/test_ckpt_world_of_one.py",
        "tests/checkpoint/test_ckpt_async.py::test_async_save_overlaps_training_and_surfaces_errors"],
    "zerotrain/checkpoint/snapshot.py": [
        "tests/checkpoint/test_ckpt_world_of_one.py",
        "tests/checkpoint/test_ckpt_async.py::test_async_save_overlaps_training_and_surfaces_errors"],
    "zerotrain/checkpoint/source.py": ["tests/checkpoint/test_ckpt_world_of_one.py"],
    # issue #48 round 6 (mut6b: commands and process plumbing), in-process first
    "zerotrain/train/command.py": ["tests/test_train_command_units.py", "tests/test_train_flags.py"],
    # a one-stage split Llama at a world of one, then the world-2 run of 2 stages (the rules of a stage that is not
    # both the first and the last: which stage reads, counts tokens, evaluates)
    "zerotrain/train/pipeline.py": ["tests/pipe/test_train_pipeline_units.py",
                                    "tests/pipe/test_pipeline_cli.py::test_train_pipeline_parallel_size_2_on_a_data_file"],
    "zerotrain/command.py": ["tests/test_command_units.py", "tests/test_train_command_units.py",
                             "tests/test_launch_units.py"],
    # `zerotrain launch` of a script under torchrun's agent: one worker, then two with a usage error
    "zerotrain/launcher.py": ["tests/test_launch_units.py"],
    "zerotrain/elastic.py": ["tests/test_launch_units.py"],
    # issue #48 round 7 (mut7b): in-process refusals and engines at a world of one, then the keyword checks
    "zerotrain/initialize.py": ["tests/test_initialize_units.py",
                                "tests/test_dropin_api.py::test_initialize_rejects_unknown_keywords_with_a_suggestion",
                                "tests/test_dropin_api.py::test_add_config_arguments_feeds_initialize"],
    "zerotrain/inference.py": ["tests/test_generate_command_units.py"],
    "zerotrain/runtime/utils.py": ["tests/test_runtime_utils_units.py"],  # against deepspeed.runtime.utils
    # the aliases in-process; CheckpointState's optional fields left out by a view (a world-of-one engine)
    "zerotrain/checkpoint/slots.py": [
        "tests/checkpoint/test_ckpt_loco_slots_units.py",
        "tests/checkpoint/test_ckpt_world_of_one.py::test_a_checkpoint_state_with_only_its_required_fields_saves_and_resumes_exactly"],
    "zerotrain/checkpoint/loco.py": ["tests/checkpoint/test_ckpt_loco_slots_units.py"],
    "zerotrain/checkpoint/optim_state.py": ["tests/checkpoint/test_ckpt_optim_state_units.py",
                                            "tests/checkpoint/test_ckpt_units.py"],
    "zerotrain/checkpoint/tools.py": ["tests/checkpoint/test_ckpt_tools_units.py"],
    "zerotrain/checkpoint/command.py": ["tests/checkpoint/test_ckpt_tools_units.py"],
    # in-process: the tracker and the settings (new), then the in-process cases of the activation checkpointing file
    "zerotrain/checkpointing/rng.py": [
        "tests/checkpointing/test_checkpointing_units.py",
        "tests/checkpointing/test_activation_checkpointing.py::test_rng_tracker_replays_a_forked_dropout_in_the_recompute",
        "tests/checkpointing/test_activation_checkpointing.py::test_rng_tracker_after_backward_is_where_the_forward_left_it_over_several_regions"],
    "zerotrain/checkpointing/settings.py": [
        "tests/checkpointing/test_checkpointing_units.py",
        "tests/checkpointing/test_activation_checkpointing.py::test_configure_reads_the_block_and_refuses_contiguous_without_partition",
        "tests/checkpointing/test_activation_checkpointing.py::test_contiguous_without_number_checkpoints_loads_and_is_checked_on_use"],
    # in-process: the monitor blocks against DeepSpeed's models, the record and writers, the memory timeline
    "zerotrain/config/monitor.py": ["tests/monitor/test_monitor.py"],
    **{f"zerotrain/monitor/{name}.py": ["tests/monitor/test_monitor.py", "tests/monitor/test_memory_timeline.py"]
       for name in ("writers", "schema", "timers", "measure", "memory_timeline")},
    # issue #48 round 5 (mut5c): in-process first; the tensor-parallel launch (4 s) partitions checkpoint inputs
    "zerotrain/monitor/throughput.py": ["tests/monitor/test_throughput.py"],  # against DeepSpeed's ThroughputTimer
    "zerotrain/checkpointing/__init__.py": [
        "tests/checkpointing/test_checkpointing_units.py",
        "tests/checkpointing/test_activation_checkpointing.py::test_checkpointing_tensor_parallel_partitions_inputs",
        "tests/checkpointing/test_activation_checkpointing.py::test_hf_gradient_checkpointing_keeps_less_for_backward",
        "tests/checkpointing/test_activation_checkpointing.py::test_rng_tracker_replays_a_forked_dropout_in_the_recompute",
        "tests/checkpointing/test_activation_checkpointing.py::test_rng_tracker_after_backward_is_where_the_forward_left_it_over_several_regions",
        "tests/checkpointing/test_activation_checkpointing.py::test_configure_reads_the_block_and_refuses_contiguous_without_partition",
        "tests/checkpointing/test_activation_checkpointing.py::test_contiguous_without_number_checkpoints_loads_and_is_checked_on_use"],
    "zerotrain/checkpointing/saved.py": [
        "tests/checkpointing/test_checkpointing_units.py",
        "tests/checkpointing/test_activation_checkpointing.py::test_checkpointing_tensor_parallel_partitions_inputs"],
    # the engine's whole weights: in-process at a world of one, data-parallel shards at world 2, tp slices at tp 2
    "zerotrain/consolidate.py": [
        "tests/test_engine_world_of_one.py",
        "tests/checkpointing/test_activation_checkpointing.py::test_checkpointing_tensor_parallel_partitions_inputs",
        "tests/zero/test_parity.py::test_stages_match_single_process[2]",
        "tests/parallel/test_moe_engine.py::test_engine_trains_split_experts_like_one_process[2-2]"],  # experts
    **{f"zerotrain/merge/{name}.py": ["tests/merge/test_merge.py"] for name in ("run", "source", "writer", "command")},
    "zerotrain/port/command.py": ["tests/port/test_port.py"],
    "zerotrain/config/loader.py": ["tests/config/test_loader.py", "tests/config/test_schema.py",
                                   "tests/config/test_config_base.py"],
    "zerotrain/config/schema.py": ["tests/config/test_schema.py", "tests/config/test_loader.py",
                                   "tests/test_option_coverage.py"],
    "zerotrain/utils/logging.py": ["tests/test_utils_shims.py"],
    "zerotrain/utils/module_utils.py": ["tests/test_utils_shims.py"],
    "zerotrain/utils/repeating.py": ["tests/test_repeating_loader.py"],
    "zerotrain/config/auto.py": ["tests/config/test_hf_arguments.py"],  # the import scan misses it (via the package)
    "zerotrain/checkpoint/plan.py": [
        "tests/checkpoint/test_ckpt_units.py",
        "tests/checkpoint/test_ckpt_experts.py::test_plan_refuses_experts_missing_from_a_data_parallel_rank",
        "tests/checkpoint/test_ckpt_experts.py::test_plan_takes_each_expert_once_from_its_expert_data_parallel_replicas",
        "tests/checkpoint/test_ckpt_write.py::test_many_rounds_and_files_per_writer_load_exactly"],
    # the aligned, double-buffered writer and the readers in-process (both I/O modes); a full disk at world 2
    "zerotrain/checkpoint/directio.py": ["tests/checkpoint/test_ckpt_units.py",
                                         "tests/checkpoint/test_ckpt_disk_full.py"],
    "zerotrain/checkpoint/format.py": [
        "tests/checkpoint/test_ckpt_units.py",
        "tests/checkpoint/test_ckpt_write.py::test_many_rounds_and_files_per_writer_load_exactly"],
    # in-process: the codec, RNG streams, trainer state, tied names; spawned: RNG resumed at world 2
    "zerotrain/checkpoint/state.py": ["tests/checkpoint/test_ckpt_state_split.py",
                                      "tests/checkpoint/test_ckpt_units.py", "tests/checkpoint/test_ckpt_rng.py"],
    # in-process: slices found, pieces joined, shapes, refusals, windowed reads; spawned: a TP2 save loaded at TP1
    "zerotrain/checkpoint/split.py": [
        "tests/checkpoint/test_ckpt_state_split.py",
        "tests/checkpoint/test_ckpt_tensor_parallel.py::test_a_local_range_of_a_split_tensor_reads_from_the_whole_tensor",
        "tests/checkpoint/test_ckpt_tensor_parallel.py::test_tp2_checkpoint_holds_whole_tensors_and_resumes_at_tp1"],
    # in-process helpers first; then a resume across worlds and stages, and damaged checkpoints refused
    "zerotrain/checkpoint/load.py": [
        "tests/checkpoint/test_ckpt_load_units.py",
        # engines at a world of one: resumes, load_checkpoint's defaults, a DeepSpeed checkpoint's import
        "tests/checkpoint/test_ckpt_world_of_one.py",
        "tests/checkpoint/test_ckpt_resume.py::test_resume_across_world_sizes_and_stages[w2s2-w1s0-w2s1]",
        "tests/checkpoint/test_ckpt_corruption.py"],
    # in-process: kept records, early commits through the ring, a failed step; spawned: the ring's rollback
    "zerotrain/offload/nvme_stream.py": [
        "tests/offload/test_offload_nvme_pipeline.py",
        "tests/offload/test_offload_units.py::test_streamed_chunks_equal_fused_adamw_bitwise",
        "tests/offload/test_offload_nvme_ring.py"],
    # in-process: every rollback cause against plain offload; spawned: parity, failures at world 2, fp16 overflow
    "zerotrain/offload/speculative.py": [
        "tests/offload/test_offload_speculation_units.py", "tests/offload/test_offload_parity.py",
        "tests/offload/test_offload_speculation.py",
        "tests/offload/test_offload_overflow.py::test_fp16_overflow_rolls_back_speculation_exactly[2]"],
    # no test file imports it by name (the plans reach it): the refusals in-process, GPT at TP2, HF models' plans
    "zerotrain/parallel/tensor.py": [
        "tests/parallel/test_tensor_parallel.py::test_bad_splits_and_plans_name_the_module",
        "tests/parallel/test_tensor_parallel.py::test_split_linears_report_the_whole_layers_features_in_both_weight_layouts",
        "tests/parallel/test_tensor_parallel.py::test_gpt_tensor_parallel_matches_single_process[2]",
        "tests/parallel/test_tensor_parallel_hf.py::test_hf_models_split_by_their_own_or_an_inferred_plan_train_like_one_process"],
    # in-process: the head checks, a rank's slice of a batch, positions and packed masks, the loss over the group,
    # the attention wrapper and a wrapped HF model on one rank; then the world-2 launch (the exchanges at SP2)
    "zerotrain/parallel/sequence.py": [
        "tests/parallel/test_sequence_parallel.py::test_heads_that_do_not_divide_are_refused_naming_the_keys",
        "tests/parallel/test_sequence_parallel.py::test_shard_shifts_once_pads_odd_lengths_and_counts_the_real_targets",
        "tests/parallel/test_sequence_parallel.py::test_sliding_window_longer_than_the_window_is_refused",
        "tests/parallel/test_sequence_parallel.py::test_positions_packed_masks_and_the_group_mean_in_process",
        "tests/parallel/test_sequence_parallel.py::test_the_attention_wrapper_hands_the_whole_sequence_and_restores_the_module",
        "tests/parallel/test_sequence_parallel.py::test_a_wrapped_hf_model_on_one_rank_computes_what_the_model_does",
        "tests/parallel/test_sequence_parallel.py::test_sequence_parallel_world2_trains_like_one_process_and_resumes_at_sp1"],
    # in-process: ep sizes, each rank's groups and a misplaced expert; then the grid's agreement under TP+EP (world 4)
    # and full_state_dict's join of expert shards and replicas (world 4, ep_size 2)
    # in-process (issue #48, round 2): transformers' own defaults and names, each scheduler type
    "zerotrain/config/hf_arguments.py": ["tests/config/test_hf_arguments.py"],
    # in-process rules first (exit status, stop file, handlers, the parent watcher), then the signal subprocesses
    # the walker in-process, then the three warning sites through their public paths
    "zerotrain/callsite.py": ["tests/test_callsite.py",
                              "tests/zero/test_stage3_init_ops.py::test_the_placeholder_warning_points_at_the_users_state_dict_call",
                              "tests/checkpoint/test_ckpt_world_of_one.py", "tests/config/test_config_base.py"],
    "zerotrain/lifecycle.py": ["tests/test_lifecycle_units.py",
                               "tests/test_lifecycle.py::test_parse_signals_names_a_bad_one",
                               "tests/test_lifecycle.py::test_a_second_signal_exits_at_once"],
    # in-process: a one-rank gloo group and the job's TCPStore (the spawned failures: test_failure_modes.py)
    "zerotrain/comm/blame.py": ["tests/comm/test_blame.py"],
    # the engine in the pytest process (a world of one) first; then the world-2 launches that see what a world of
    # one cannot (LoCo's rescale and checkpoint, rank 1's {} and the masters published after a load)
    "zerotrain/engine/facade.py": ["tests/test_engine_world_of_one.py"],
    "zerotrain/engine/core.py": ["tests/test_engine_world_of_one.py",
                                 "tests/test_budget.py::test_the_first_pass_keeps_its_activations_out_of_the_parameter_cache",
                                 "tests/zero/test_zeropp_training.py::test_loco_reset_save_load_rescale_and_overflow"],
    "zerotrain/engine/state.py": ["tests/test_engine_world_of_one.py", "tests/zero/test_loco_resume.py"],
    "zerotrain/engine/export.py": ["tests/test_engine_world_of_one.py",
                                   "tests/test_dropin_api.py::test_engine_api_and_dist_at_world_two"],
    "zerotrain/engine/weights.py": [
        "tests/test_engine_world_of_one.py",
        "tests/checkpoint/test_ckpt_tensor_parallel.py::test_frozen_split_parameter_saves_at_stage3_loads_and_saves_at_stage1",
        "tests/checkpoint/test_ckpt_resume.py::test_resume_across_world_sizes_and_stages[bf16-w2s3-w4s1-w1s0]"],
    # what only more ranks show: split experts (groups, generate kept in step), rank 0's initial state, stage 3
    # under qgZ, the pipeline's norm over stages
    "zerotrain/engine/parts.py": [
        "tests/test_engine_world_of_one.py",
        "tests/parallel/test_moe_engine.py::test_engine_trains_split_experts_like_one_process[2-2]",
        "tests/test_engine_api.py::test_ranks_start_from_rank_zero_state[0]",
        "tests/zero/test_zeropp_training.py::test_zeropp_training_close_to_exact[world2]",
        "tests/pipe/test_pipeline.py::test_pp2_schedules_fp16_lora_async_save_match_single_process"],
    "zerotrain/moe/utils.py": ["tests/port/test_port.py::test_moe_groups_and_module_utils"],
    "zerotrain/parallel/autotp.py": [
        "tests/parallel/test_tensor_parallel_hf.py::test_plans_are_resolved_or_refused_by_name_before_any_process_group"],
    # the Protocols' neutral defaults run inside the engine's parts (the import scan finds no test)
    "zerotrain/zero/interfaces.py": ["tests/test_engine_world_of_one.py"],
    "zerotrain/training_engine.py": ["tests/test_training_engine.py"],
    "zerotrain/comm/handles.py": ["tests/comm/test_counters.py", "tests/comm/test_blame.py",
                                  "tests/comm/test_error_feedback.py"],
    # issue #48 round 5 (mut5a): every Comm method and comm.autograd's functions against one process's math in the
    # gloo launch (worlds 2, 3); the same-host transport's own launches and its liveness check
    "zerotrain/comm/core.py": ["tests/comm/test_gloo_point_to_point.py", "tests/comm/test_counters.py",
                               "tests/test_engine_world_of_one.py::test_a_kept_model_does_not_keep_its_process_group_past_teardown"],
    "zerotrain/comm/at_exit.py": ["tests/comm/test_at_exit.py"],
    "zerotrain/comm/autograd.py": [
        "tests/comm/test_gloo_point_to_point.py::test_point_to_point_matches_gloo_collectives[2-float32]"],
    "zerotrain/parallel/gather.py": [
        "tests/parallel/test_tensor_parallel_plan_units.py::test_a_group_of_one_assembles_its_own_tensors",
        "tests/parallel/test_tensor_parallel.py::test_gpt_tensor_parallel_matches_single_process[2]"],
    "zerotrain/ops/adam.py": ["tests/port/test_port.py::test_ops_adam_are_torchs_adam_with_deepspeeds_defaults",
                              "tests/test_optim_defaults.py::test_ops_adam_shims_have_deepspeeds_signature_defaults"],
    "zerotrain/accelerator/real_accelerator.py": [
        "tests/port/test_port.py::test_accelerator_on_the_cpu_means_what_deepspeeds_does",
        "tests/port/test_port.py::test_the_accelerator_is_chosen_by_ds_accelerator_once_per_process_and_the_cpus_answers",
        "tests/port/test_port.py::test_accelerator_on_cuda"],
    # in-process at a world of one (round 7, mut7c); the reduce op and a default source need two ranks:
    # tests/test_dropin_api.py::test_engine_api_and_dist_at_world_two (minutes; run for those mutants with --only)
    "zerotrain/dist.py": ["tests/test_dist_units.py"],
    "zerotrain/comm/same_host.py": [
        "tests/comm/test_same_host.py::test_a_peer_that_exited_counts_as_dead_before_it_is_reaped",
        "tests/comm/test_same_host.py::test_same_host_matches_sockets",
        "tests/comm/test_same_host.py::test_turned_off_by_environment",
        "tests/comm/test_same_host.py::test_dead_peer_is_named_not_waited_for",
        "tests/comm/test_same_host.py::test_silent_peer_times_out",
        "tests/comm/test_same_host.py::test_siblings_allowed_only_under_yama_scope_1_with_one_parent",
        "tests/comm/test_gloo_point_to_point.py"],
    "zerotrain/comm/__init__.py": ["tests/comm/test_counters.py"],
    # in-process: rank 1 of 2's slices, Conv1D, divide_parent, refusals, SumGrad's hooks; then GPT at TP2 (and the
    # SumGrad module's summed gradient in the same launch)
    "zerotrain/parallel/plan.py": [
        "tests/parallel/test_tensor_parallel_plan_units.py",
        "tests/parallel/test_tensor_parallel.py::test_bad_splits_and_plans_name_the_module",
        "tests/parallel/test_tensor_parallel.py::test_gpt_tensor_parallel_matches_single_process[2]"],
    "zerotrain/parallel/__init__.py": [
        "tests/parallel/test_tensor_parallel.py::test_gpt_tensor_parallel_matches_single_process[2]"],
    "zerotrain/parallel/slices.py": [
        "tests/parallel/test_tensor_parallel.py::test_split_slices_are_megatrons_layout_and_tile_the_tensor",
        "tests/parallel/test_tensor_parallel.py::test_bad_splits_and_plans_name_the_module",
        "tests/checkpoint/test_ckpt_state_split.py"],
    # in-process: DeepSpeed's defaults, then the schema's rules
    "zerotrain/config/zero.py": ["tests/config/test_zero_defaults.py", "tests/config/test_schema.py"],
    "zerotrain/config/batch.py": ["tests/config/test_batch.py"],
    "zerotrain/config/base.py": ["tests/config/test_config_base.py", "tests/config/test_schema.py",
                                 "tests/config/test_loader.py"],
    # in-process: the per-layer values, the YAML's base model, the default shard size; then the merges (not the
    # spawned real-checkpoint test)
    "zerotrain/merge/recipe.py": [
        "tests/merge/test_merge.py::test_per_layer_values_interpolate_between_their_neighbours",
        "tests/merge/test_merge.py::test_yaml_slerp_takes_its_base_model_first_and_other_methods_keep_their_list",
        "tests/merge/test_merge.py::test_without_a_shard_size_the_output_is_one_file",
        "tests/merge/test_merge.py::test_linear_writes_weighted_mean_index_and_loads",
        "tests/merge/test_merge.py::test_task_arithmetic_and_ties", "tests/merge/test_merge.py::test_dare_is_seeded_and_keeps_density",
        "tests/merge/test_merge.py::test_yaml_slerp_with_layer_gradient", "tests/merge/test_merge.py::test_include_exclude",
        "tests/merge/test_merge.py::test_mismatches_name_tensor_and_file",
        "tests/merge/test_merge.py::test_vocab_mismatch_error_and_tokenizer_source",
        "tests/merge/test_merge.py::test_lora_folding_and_ckpt_export",
        "tests/merge/test_merge.py::test_source_dtype_kept_and_bad_params",
        "tests/merge/test_merge.py::test_unified_checkpoint_input_reads_masters_and_manifest_checksums"],
    # spawned at world 4: Init's shards, `with Init() as x`, its dtype on float parameters only; then a modifier
    # rank's write-back (GatheredParameters)
    "zerotrain/zero/stage3/context.py": [
        "tests/zero/test_stage3_init.py::test_init_holds_only_shards_and_gathers_the_plain_model",
        "tests/zero/test_stage3_init.py::test_initializers_on_partitioned_parameters_change_only_the_local_shard",
        "tests/zero/test_stage3_memory.py::test_gathered_parameters_modifier_changes_what_every_rank_trains"],
    # in-process formats and bad records first; the spawned rank-0 builder (the import scan found only this one)
    "zerotrain/data/records.py": ["tests/data/test_local_data.py", "tests/data/test_data_distributed.py"],
    "zerotrain/sharding.py": ["tests/test_sharding.py", "tests/zero/test_flat.py", "tests/zero/test_optimizer_units.py",
                              "tests/checkpoint/test_ckpt_load_units.py"],
    "zerotrain/parallel/experts.py": [
        "tests/parallel/test_moe_engine.py::test_expert_groups_of_each_rank_and_a_misplaced_or_uneven_expert_in_process",
        "tests/parallel/test_moe_engine.py::test_bad_ep_sizes_are_refused_naming_them",
        "tests/parallel/test_moe_engine.py::test_split_experts_with_tensor_parallelism_pass_the_up_front_check",
        "tests/parallel/test_tensor_expert_parallel.py::test_experts_split_over_tensor_parallel_ranks_are_refused_naming_them",
        "tests/parallel/test_moe_engine.py::test_engine_trains_split_experts_like_one_process[4-2]"],
    # in-process: DeepSpeed's cut (ties), the checkpointing/seed keywords, dotted names and tied owners, the
    # refusals; one world-1 launch (the frozen-run refusal, a built stage training as plain PyTorch)
    "zerotrain/pipe/module.py": [
        "tests/pipe/test_deepspeed_pipeline.py::test_the_cut_is_deepspeeds_partition_ties_included",
        "tests/pipe/test_deepspeed_pipeline.py::test_pipeline_module_takes_deepspeeds_checkpointing_and_seed_arguments",
        "tests/pipe/test_deepspeed_pipeline.py::test_dotted_layer_names_and_tied_owner_names",
        "tests/pipe/test_deepspeed_pipeline.py::test_a_run_that_would_train_nothing_fails_and_a_built_stage_trains",
        "tests/pipe/test_pipeline.py::test_partition_methods", "tests/pipe/test_pipeline.py::test_refusals_name_the_key"],
    # in-process first (the refusals, the reference engine's config), then the one world-2 launch of DPO, reward and
    # GRPO against TRL + DeepSpeed (shared by the three files), then SFT's
    "zerotrain/hf/trl.py": [
        "tests/hf/test_arguments.py::test_trl_features_not_built_are_refused_by_name",
        "tests/hf/test_arguments.py::test_the_reference_models_engine_config_is_forward_only_zero3",
        "tests/hf/test_grpo.py", "tests/hf/test_dpo.py", "tests/hf/test_reward.py", "tests/hf/test_sft.py"],
    # in-process: the optimizer built from a block against DeepSpeed 0.19.8's classes' defaults (the offload engines
    # and the HF Trainer case of test_optim_defaults.py are left out: imports and engines, not the defaults' logic)
    "zerotrain/optim.py": [
        "tests/test_optim.py", "tests/test_optim_defaults.py::test_adam_block_takes_deepspeeds_defaults",
        "tests/test_optim_defaults.py::test_torch_adam_takes_torchs_own_defaults",
        "tests/test_optim_defaults.py::test_sgd_block_takes_torchs_sgd_defaults"],
    "zerotrain/config/params.py": [
        "tests/config/test_schema.py", "tests/test_optim.py", "tests/test_schedules.py",
        "tests/test_optim_defaults.py::test_adam_block_takes_deepspeeds_defaults"],
    # issue #48, round 4 (pipeline, train commands): the in-process tests first (a one-stage engine at a world of
    # one, the pieces' placement against torch's, the GPT and Llama layers against their models), then the refusals
    # and the world-1 / world-2 launches (tied copies over stages, PP2 schedules, fp16, an async save's resume)
    "zerotrain/pipe/engine.py": [
        "tests/pipe/test_pipe_units.py", "tests/pipe/test_pipeline.py::test_refusals_name_the_key",
        "tests/pipe/test_deepspeed_pipeline.py::test_a_run_that_would_train_nothing_fails_and_a_built_stage_trains",
        "tests/pipe/test_pipeline.py::test_pp2_schedules_fp16_lora_async_save_match_single_process"],
    "zerotrain/pipe/schedule.py": ["tests/pipe/test_pipe_units.py", "tests/pipe/test_pipeline.py::test_estimate_per_stage"],
    "zerotrain/pipe/gpt.py": ["tests/pipe/test_pipe_units.py"],
    "zerotrain/pipe/hf.py": [
        "tests/pipe/test_pipe_units.py::test_a_split_llama_on_one_rank_computes_the_models_loss_under_its_names",
        "tests/pipe/test_pipeline.py::test_refusals_name_the_key"],
    "zerotrain/pipe/checkpoint.py": [
        "tests/pipe/test_pipe_units.py::test_a_one_stage_pipeline_trains_evaluates_and_resumes_as_plain_pytorch",
        "tests/pipe/test_pipeline.py::test_pp2_schedules_fp16_lora_async_save_match_single_process"],
    # in-process (the sample ran test_train_flags.py without its README walkthrough: shell blocks in subprocesses)
    "zerotrain/train/flags.py": ["tests/test_train_flags_units.py", "tests/test_train_flags.py"],
    # in-process: both Pooling config formats, the record's metric fields; then the pooling modes and the data
    "zerotrain/embedding/pooling.py": ["tests/embedding/test_embedding_units.py", "tests/embedding/test_data.py"],
    "zerotrain/embedding/metrics.py": ["tests/embedding/test_embedding_units.py"],
    "zerotrain/embedding/data.py": ["tests/embedding/test_embedding_units.py", "tests/embedding/test_data.py"],
    "zerotrain/train/resume.py": [
        "tests/test_train_resume_units.py",
        "tests/test_cli.py::test_resume_from_a_named_checkpoint_names_intact_ones_and_warns_of_another_max_steps"],
    # issue #48, round 5 (mut5d): in-process only (the world-2 launches of test_estimate.py and
    # test_deepspeed_programs.py take minutes; not run per mutant)
    "zerotrain/estimate.py": [
        "tests/test_estimate.py::test_estimate_matches_the_engine_at_a_world_of_one",
        "tests/test_estimate.py::test_meta_attention_keeps_what_the_real_kernel_keeps",
        "tests/test_estimate.py::test_a_model_of_unknown_inputs_has_no_measured_activations",
        "tests/test_estimate.py::test_estimate_of_a_hugging_face_config_builds_nothing",
        "tests/test_estimate.py::test_estimate_command_table_json_and_errors",
        "tests/test_estimate.py::test_largest_model_that_fits_a_memory",
        "tests/test_estimate.py::test_stage3_peak_counts_its_gradient_shards_or_the_activations_not_both",
        "tests/test_estimate.py::test_expert_parallel_states_and_the_largest_moe_that_fits",
        "tests/test_estimate.py::test_estimate_default_device_labelled_searches_and_no_local_budget_for_a_cluster",
        "tests/test_estimate.py::test_the_nvme_peak_counts_the_tied_weights_zero_init_wrote",
        "tests/test_estimate.py::test_qgz_loco_buffers_of_one_and_two_hops_are_the_reducers",  # round 6 (mut6d)
        "tests/test_estimate.py::test_the_estimates_options_are_estimate_option_on_the_device_asked",
        # issue #43: the first pass's activations out of the parameter cache, the NVMe cases at a world of one
        "tests/test_estimate.py::test_a_cpu_first_pass_peak_takes_its_activations_out_of_the_parameter_cache",
        "tests/test_estimate.py::test_estimate_matches_the_engine_on_nvme_at_a_world_of_one",
        "tests/test_fp8.py::test_estimate_adds_the_largest_float8_transient_and_no_state",  # fp8's row (in-process)
        # round 7 (mut7a), in-process: the largest-fit search's probes, the command's flags and table lines, the
        # pipeline's per-stage lines
        "tests/test_estimate.py::test_the_largest_fit_search_builds_only_the_models_its_prediction_and_check_need",
        "tests/test_estimate.py::test_the_command_passes_and_prints_what_it_was_asked",
        "tests/pipe/test_pipeline.py::test_estimate_per_stage",
        "tests/test_budget.py"],
    "zerotrain/pretrained.py": ["tests/test_pretrained_units.py"],
    "zerotrain/plots.py": ["tests/test_plots.py", "tests/monitor/test_memory_timeline.py"],
    # issue #48 round 5 (mut5b). The HF Trainer at a world of one against transformers' own Trainer (in-process),
    # then the arguments and refusals, the optimizer block's weight decay
    "zerotrain/hf/trainer.py": [
        "tests/hf/test_trainer_units.py", "tests/hf/test_arguments.py",
        "tests/test_optim_defaults.py::test_hf_trainer_optimizer_block_takes_deepspeeds_defaults_and_no_block_the_trainers"],
    "zerotrain/hf/__init__.py": ["tests/hf/test_arguments.py"],
    "zerotrain/__init__.py": [
        "tests/test_dropin_api.py::test_add_config_arguments_parses_as_deepspeeds_and_adds_zerotrain_config",
        "tests/test_dropin_api.py::test_add_config_arguments_feeds_initialize"],
    # in-process units; the world-2 launch last (the restart count the ranks agree on)
    "zerotrain/run/__init__.py": [
        "tests/test_run_units.py", "tests/test_hostfile.py::test_a_requeued_slurm_job_resumes",
        "tests/test_cli.py::test_trainer_resumed_at_world2_trains_on_the_samples_the_uninterrupted_run_did"],
    # in-process: the checkpoint's embedding state, PairSteps over three epochs against plain PyTorch; the pair data
    "zerotrain/embedding/steps.py": ["tests/embedding/test_embedding_units.py", "tests/embedding/test_data.py"],
    # in-process: the only tests that reach chat.py (has_chat_records, prepare_chat_tokenizer; run/lm.py its caller)
    "zerotrain/data/chat.py": [
        "tests/data/test_local_data.py::test_chat_records_are_recognised_in_every_layout_from_the_first_64_records",
        "tests/data/test_local_data.py::test_chat_template_tokens_are_added_and_chatml_is_the_default"],
    # in-process (the tests import zerotrain.data's re-exports: the import scan finds none)
    "zerotrain/data/corpus.py": ["tests/data/test_corpus.py"],
    "zerotrain/data/local.py": ["tests/data/test_local_data.py"],
    # issue #48 round 7 (mut7c), in-process: the metrics on ties and the 10th place by hand, the pairs and the limits
    "zerotrain/embedding/retrieval.py": [
        "tests/embedding/test_loss.py::test_retrieval_metrics_on_known_ranks",
        "tests/embedding/test_loss.py::test_retrieval_metrics_count_ties_for_the_query_and_cut_at_the_tenth_place",
        "tests/embedding/test_loss.py::test_stdlib_pairs_split_by_module",
        "tests/embedding/test_loss.py::test_stdlib_pairs_take_each_documented_functions_first_paragraph_once_and_stop_where_asked",
        "tests/embedding/test_embedding_units.py::test_each_retrieval_metric_is_recorded_under_its_own_schema_field"],
    # the command function in the pytest process: options, refusals, world-of-one runs (test_resume.py: launches)
    "zerotrain/embedding/command.py": ["tests/embedding/test_embedding_command_units.py", "tests/test_train_flags.py"],
    # in-process: an export per pooling mode loaded by sentence-transformers (test_export.py's launch: minutes)
    "zerotrain/embedding/export.py": [
        "tests/embedding/test_embedding_units.py::test_an_exported_encoder_encodes_in_sentence_transformers_as_our_encode"],
    "zerotrain/run/model.py": [
        "tests/test_run_model_units.py",
        "tests/test_train_flags.py::test_the_flag_built_adamw_does_not_decay_biases_and_norm_weights_as_the_hf_trainer"],
    # in-process runs of `zerotrain train` (one rank), then the spawned end-to-end run (--memory-timeline)
    "zerotrain/run/lm.py": ["tests/test_run_lm_units.py", "tests/test_run.py",
                            "tests/test_cli.py::test_train_tiny_end_to_end"],
    # issue #48 round 6 (mut6a), in-process: the GPT's forwards (checkpointed, a sequence-parallel group of one), init
    "zerotrain/models/gpt.py": ["tests/models/test_gpt.py"],
    # the session's tiny Llama directory read back by transformers; the chat jsonl
    "zerotrain/models/tiny_llama.py": ["tests/models/test_tiny_llama.py"],
    # the world-of-one layer against the mixture written out, then the world-2 exchange against it
    "zerotrain/parallel/moe.py": [
        "tests/parallel/test_moe.py::test_one_rank_layer_is_the_top_k_mixture_and_a_rank_holds_its_experts_initialised_alike",
        "tests/parallel/test_moe.py::test_expert_parallel_moe_matches_all_local_experts[2]"],
    # rank 1 of 2's LoRA slices in-process (test_lora.py's world-2 launch takes minutes)
    "zerotrain/parallel/adapters.py": [
        "tests/parallel/test_tensor_parallel_plan_units.py::test_lora_adapters_are_split_along_their_base_layer_for_rank_one"],
    # issue #48 round 6 (mut6d): the forward-only engine in-process (counts, phases, releases, NVMe reads ahead,
    # synced_gpus), then its memory report and a training engine's generate
    "zerotrain/zero/forward_only.py": [
        "tests/zero/test_forward_only_units.py",
        "tests/test_engine_world_of_one.py::test_a_forward_only_engine_holds_no_gradients_and_computes_the_model",
        "tests/test_engine_world_of_one.py::test_generate_between_training_steps_runs_in_eval_mode_without_grad",
        "tests/zero/test_stage3_fetch_units.py::test_generate_between_steps_releases_even_a_parameter_used_outside_its_module"],
}

# Method names whose swap is a plausible slip (the GQA bug: repeat for repeat_interleave).
_METHOD_SWAPS = {"repeat_interleave": "repeat", "sum": "mean", "mean": "sum", "max": "min", "min": "max",
                 "amax": "amin", "amin": "amax", "argmax": "argmin", "argmin": "argmax", "floor": "ceil",
                 "ceil": "floor", "add_": "sub_", "sub_": "add_", "mul_": "div_", "div_": "mul_",
                 "clamp_min": "clamp_max", "clamp_max": "clamp_min"}
_COMPARE_SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
                  ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
_BINOP_SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
                ast.FloorDiv: ast.Mult, ast.Pow: ast.Mult, ast.Mod: ast.FloorDiv}
_DROPPABLE = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv)
_QUIET_CALLS = re.compile(r"^(logger|logging|log)\.|^warnings\.warn$")


@dataclass(frozen=True)
class Mutant:
    """One change of the source: bytes [start, end) of the file become `replacement`."""
    path: str
    line: int
    start: int
    end: int
    replacement: str
    operator: str
    original: str

    context: str = ""  # the line's text and which of its identical changes this is

    @property
    def id(self) -> str:
        """Stable across edits elsewhere in the file: the path, the operator, the changed text and the line's
        text (not its number)."""
        key = f"{self.path}\0{self.operator}\0{self.original}\0{self.replacement}\0{self.context}"
        return hashlib.sha1(key.encode()).hexdigest()[:10]

    def apply(self, source: bytes) -> bytes:
        return source[:self.start] + self.replacement.encode() + source[self.end:]

    def diff(self, source: bytes) -> str:
        before = source.decode().splitlines(keepends=True)
        after = self.apply(source).decode().splitlines(keepends=True)
        return "".join(difflib.unified_diff(before, after, f"a/{self.path}", f"b/{self.path}", n=0))


# --- making mutants ---------------------------------------------------------------------------------

class _Mutator(ast.NodeVisitor):
    """Walks a module's ast; `found` collects (node, replacement text, operator) for every mutant."""

    def __init__(self, siblings: Optional["_Siblings"] = None) -> None:
        self.found: list[tuple[ast.AST, str, str]] = []
        self.siblings = siblings or _Siblings()

    def add(self, node: ast.AST, replacement: ast.AST | str, operator: str) -> None:
        text = replacement if isinstance(replacement, str) else _text(replacement)
        self.found.append((node, text, operator))

    # subtrees that hold no behaviour worth mutating
    def visit_Module(self, node: ast.Module) -> None:
        for statement in node.body[1:] if node.body and _is_docstring(node.body[0]) else node.body:
            self.visit(statement)

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:  # f-strings: messages, but generated text loses
        # an indent like a plain string does (below); nothing else of an f-string is mutated
        parts = [ast.Constant(_dedent(v.value)) if isinstance(v, ast.Constant) and isinstance(v.value, str) else v
                 for v in node.values]
        if any(isinstance(a, ast.Constant) and a.value != b.value for a, b in zip(parts, node.values)):
            self.add(node, ast.JoinedStr(parts), "drop indent")

    def visit_arg(self, node: ast.arg) -> None:  # annotations
        return

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        body = node.body[1:] if _is_docstring(node.body[0]) else node.body
        for default in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            self.visit(default)
        for statement in body:
            self.visit(statement)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for statement in node.body[1:] if _is_docstring(node.body[0]) else node.body:
            self.visit(statement)

    def visit_Assign(self, node: ast.Assign) -> None:
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return
        self.generic_visit(node)

    def visit_Raise(self, node: ast.Raise) -> None:  # the error's text; the condition above it is mutated
        return

    def visit_Assert(self, node: ast.Assert) -> None:
        self.visit(node.test)

    # operators
    def visit_Compare(self, node: ast.Compare) -> None:
        for index, op in enumerate(node.ops):
            swap = _COMPARE_SWAPS.get(type(op))
            if swap is not None:
                ops = list(node.ops)
                ops[index] = swap()
                self.add(node, ast.Compare(node.left, ops, node.comparators), "compare")
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        swap = _BINOP_SWAPS.get(type(node.op))
        if swap is not None:
            self.add(node, ast.BinOp(node.left, swap(), node.right), "binop")
        if isinstance(node.op, _DROPPABLE):
            self.add(node, node.left, "drop right operand")
            if not isinstance(node.op, (ast.Div, ast.FloorDiv)):  # `x / y` -> `y` is rarely plausible
                self.add(node, node.right, "drop left operand")
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        swap = _BINOP_SWAPS.get(type(node.op))
        if swap is not None:
            self.add(node, ast.AugAssign(node.target, swap(), node.value), "augassign")
        self.add(node, "pass", "drop statement")
        self.visit(node.value)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        other = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        self.add(node, ast.BoolOp(other, node.values), "and/or")
        for index in range(len(node.values)):  # `a or b or c` -> `a or c`: one term of the rule forgotten
            rest = node.values[:index] + node.values[index + 1:]
            self.add(node, rest[0] if len(rest) == 1 else ast.BoolOp(node.op, rest), "drop bool term")
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if isinstance(node.op, (ast.Not, ast.USub)):
            self.add(node, node.operand, "drop unary")
        self.generic_visit(node)

    def _negate(self, test: ast.expr) -> None:
        # `not (a == b)` is the compare mutant already, `not not a` the dropped `not`
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            return
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and \
                isinstance(test.ops[0], (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)):
            return
        self.add(test, ast.UnaryOp(ast.Not(), test), "negate condition")

    def visit_If(self, node: ast.If) -> None:
        self._negate(node.test)
        self.generic_visit(node)

    visit_While = visit_If

    def visit_IfExp(self, node: ast.IfExp) -> None:
        self._negate(node.test)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        value = node.value
        if isinstance(value, bool) or value is None:
            if isinstance(value, bool):
                self.add(node, repr(not value), "constant")
        elif isinstance(value, int):
            self.add(node, repr(value + 1), "constant +1")
            self.add(node, repr(value - 1), "constant -1")
        elif isinstance(value, float):
            self.add(node, repr(1.0 if value == 0 else value * 2), "constant")
        elif isinstance(value, str) and _dedent(value) != value:
            self.add(node, repr(_dedent(value)), "drop indent")

    def visit_Dict(self, node: ast.Dict) -> None:
        # a key replaced by a sibling key of the same dict (the next one; the last takes the one before): one
        # entry written under the wrong name, e.g. a mapping's row that sets its neighbour's key
        keys = [k for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
        if len(keys) >= 2:
            for index, key in enumerate(keys):
                sibling = keys[index + 1] if index + 1 < len(keys) else keys[index - 1]
                if sibling.value != key.value:
                    self.add(key, repr(sibling.value), "sibling key")
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        # `obj["a"]` -> `obj["b"]`, "b" another key the module reads or writes on the same `obj`
        key = node.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            sibling = self.siblings.nearest(("[]", _text(node.value)), key.value)
            if sibling is not None:
                self.add(key, repr(sibling), "sibling key")
        self.generic_visit(node)

    def visit_Slice(self, node: ast.Slice) -> None:
        for bound in (node.lower, node.upper):
            if bound is not None and not isinstance(bound, ast.Constant):
                self.add(bound, ast.BinOp(bound, ast.Add(), ast.Constant(1)), "slice bound +1")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id == "abs" and len(node.args) == 1:
            self.add(node, node.args[0], "drop abs")
        if isinstance(func, ast.Name) and func.id in ("max", "min") and len(node.args) >= 2:
            self.add(node, ast.Call(ast.Name("min" if func.id == "max" else "max"), node.args, node.keywords),
                     "max/min")
        if isinstance(func, ast.Attribute) and func.attr in _METHOD_SWAPS:
            swapped = ast.Attribute(func.value, _METHOD_SWAPS[func.attr], func.ctx)
            self.add(node, ast.Call(swapped, node.args, node.keywords), "method swap")
        positional = [a for a in node.args if not isinstance(a, ast.Starred)]
        commutative = isinstance(func, ast.Name) and func.id in ("max", "min")  # swapping is equivalent
        if len(positional) == len(node.args) >= 2 and not commutative and _text(node.args[0]) != _text(node.args[1]):
            args = [node.args[1], node.args[0], *node.args[2:]]
            self.add(node, ast.Call(func, args, node.keywords), "swap arguments")
        if not commutative:
            # two neighbouring arguments of the same kind swapped, beyond the first two positional ones (above):
            # `f(a, b, c)` -> `f(a, c, b)`, `f(x=a, y=b)` -> `f(x=b, y=a)`
            for index in range(1, len(positional) - 1):
                if len(positional) == len(node.args) and _same_kind(node.args[index], node.args[index + 1]):
                    args = list(node.args)
                    args[index], args[index + 1] = args[index + 1], args[index]
                    self.add(node, ast.Call(func, args, node.keywords), "swap same-type arguments")
            named = [k for k in node.keywords if k.arg is not None]
            for first, second in zip(named, named[1:]):
                if _same_kind(first.value, second.value):
                    self.add(node, ast.Call(func, node.args, [
                        ast.keyword(k.arg, second.value if k is first else first.value if k is second else k.value)
                        for k in node.keywords]), "swap same-type arguments")
            # a keyword renamed to a sibling one: another keyword the module passes to the same callee
            present = {k.arg for k in node.keywords}
            for keyword in named:
                sibling = self.siblings.nearest(("()", _text(func)), keyword.arg, exclude=present)
                if sibling is not None:
                    self.add(node, ast.Call(func, node.args, [ast.keyword(sibling if k is keyword else k.arg, k.value)
                                                              for k in node.keywords]), "sibling key")
        if isinstance(func, ast.Attribute) and func.attr in ("get", "pop", "setdefault") and node.args and \
                isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            sibling = self.siblings.nearest(("[]", _text(func.value)), node.args[0].value)
            if sibling is not None:
                self.add(node.args[0], repr(sibling), "sibling key")
        self.generic_visit(node)

    def visit_Expr(self, node: ast.Expr) -> None:
        call = node.value.value if isinstance(node.value, ast.Await) else node.value
        if isinstance(call, ast.Call) and not _QUIET_CALLS.match(_text(call.func)):
            self.add(node, "pass", "drop call")
        self.generic_visit(node)

    def visit_Return(self, node: ast.Return) -> None:
        if node.value is not None and not (isinstance(node.value, ast.Constant) and node.value.value is None):
            self.add(node, "return None", "drop return value")
        self.generic_visit(node)


class _Siblings:
    """The names a module uses together: keywords passed to each callee (`("()", callee text)`) and string keys
    read or written on each object (`("[]", object text)`: `obj["k"]`, `obj.get("k")`, `obj.pop("k")`)."""

    def __init__(self, tree: Optional[ast.AST] = None) -> None:
        self.names: dict[tuple[str, str], set[str]] = {}
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, ast.Call):
                for keyword in node.keywords:
                    if keyword.arg is not None:
                        self.names.setdefault(("()", _text(node.func)), set()).add(keyword.arg)
                func = node.func
                if isinstance(func, ast.Attribute) and func.attr in ("get", "pop", "setdefault") and node.args and \
                        isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                    self.names.setdefault(("[]", _text(func.value)), set()).add(node.args[0].value)
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and \
                    isinstance(node.slice.value, str):
                self.names.setdefault(("[]", _text(node.value)), set()).add(node.slice.value)

    def nearest(self, where: tuple[str, str], name: str, exclude: frozenset | set = frozenset()) -> Optional[str]:
        """The sibling of `name` at `where` most like it (the longest common prefix, then sorted), else None."""
        others = sorted(self.names.get(where, set()) - {name} - set(exclude))
        if not others:
            return None
        return max(others, key=lambda other: len(os.path.commonprefix([name, other])))


def _dedent(text: str) -> str:
    """`text` with one indent (4 spaces, or what there is) less after every newline that has one."""
    return re.sub(r"\n( {1,4})", "\n", text)


def _same_kind(first: ast.expr, second: ast.expr) -> bool:
    """Two arguments a swap keeps plausible: constants of one type, or two names/attributes/subscripts; never
    the same text."""
    if _text(first) == _text(second):
        return False
    if isinstance(first, ast.Constant) and isinstance(second, ast.Constant):
        return type(first.value) is type(second.value) and first.value is not None
    refs = (ast.Name, ast.Attribute, ast.Subscript)
    return isinstance(first, refs) and isinstance(second, refs)


def _is_docstring(statement: ast.stmt) -> bool:
    return isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant) and \
        isinstance(statement.value.value, str)


def _text(node: ast.AST) -> str:
    """Source text of a (possibly new) node; parenthesized expressions keep their place in any context."""
    text = ast.unparse(ast.fix_missing_locations(node))
    if isinstance(node, ast.expr) and not isinstance(node, (ast.Name, ast.Constant, ast.Attribute, ast.Call,
                                                            ast.Subscript)):
        return f"({text})"
    return text


def _offsets(source: bytes) -> list[int]:
    """Byte offset of the start of each line (1-based line numbers index it after a leading 0)."""
    starts = [0, 0]
    for index, byte in enumerate(source):
        if byte == 0x0A:
            starts.append(index + 1)
    return starts


def mutants_of(path: str, source: Optional[bytes] = None) -> list[Mutant]:
    """Every mutant of the file at `path` (relative to the repository root), in source order; each compiles."""
    source = (ROOT / path).read_bytes() if source is None else source
    tree = ast.parse(source)
    mutator = _Mutator(_Siblings(tree))
    mutator.visit(tree)
    starts = _offsets(source)
    lines = source.decode().splitlines()
    out, seen, occurrences = [], set(), {}
    for node, replacement, operator in sorted(mutator.found, key=lambda f: (f[0].lineno, f[0].col_offset)):
        start = starts[node.lineno] + node.col_offset
        end = starts[node.end_lineno] + node.end_col_offset
        original = source[start:end].decode()
        if replacement == original or (start, end, replacement) in seen:
            continue
        seen.add((start, end, replacement))
        line = lines[node.lineno - 1].strip()
        nth = occurrences[(line, operator, original, replacement)] = \
            occurrences.get((line, operator, original, replacement), -1) + 1
        mutant = Mutant(path, node.lineno, start, end, replacement, operator, original, context=f"{line}\0{nth}")
        try:
            compile(mutant.apply(source), path, "exec")
        except SyntaxError:
            continue
        out.append(mutant)
    return sorted(out, key=lambda m: (m.start, m.end, m.replacement))


# --- which tests ----------------------------------------------------------------------------------

def _dotted(path: str) -> str:
    name = path[:-3] if path.endswith(".py") else path
    name = name.replace("/", ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def covering_tests(path: str) -> list[str]:
    """The declared tests of `path` (COVERING), or else every test file that imports its module (at any
    depth of the file: spawned functions import inside themselves) or names it in `from package import`."""
    if path in COVERING:
        return COVERING[path]
    module = _dotted(path)
    package, _, leaf = module.rpartition(".")
    found = []
    for test in sorted((ROOT / "tests").rglob("test_*.py")):
        tree = ast.parse(test.read_bytes())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            if any(name == module or name.startswith(module + ".") for name in names) or \
                    (isinstance(node, ast.ImportFrom) and node.module == package and
                     any(alias.name == leaf for alias in node.names)):
                found.append(str(test.relative_to(ROOT)))
                break
    return found


# --- running --------------------------------------------------------------------------------------

def load_equivalents(path: Path = EQUIVALENTS) -> dict[str, str]:
    """id -> reason, from lines `ID  FILE  reason` (# comments and blank lines skipped)."""
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip() if line.lstrip().startswith("#") else line.strip()
        if line:
            parts = line.split(None, 2)
            out[parts[0]] = parts[2] if len(parts) > 2 else ""
    return out


def run_tests(tests: list[str], timeout: float, extra_env: Optional[dict] = None) -> tuple[str, float]:
    """('passed' | 'failed' | 'timeout', seconds) of pytest over `tests`, in its own process group (killed
    whole, spawned ranks included, at the time limit)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONDONTWRITEBYTECODE="1", ZEROTRAIN_TEST_RUN_TIMEOUT=str(int(timeout)), **(extra_env or {}))
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header",
               f"--timeout={int(timeout)}", *tests]
    start = time.monotonic()
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    code = None
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        if process.poll() is None or code is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
    seconds = time.monotonic() - start
    if code is None:
        return "timeout", seconds
    return ("passed" if code == 0 else "failed"), seconds


class MutatedFile:
    """`with MutatedFile(path) as put:` then `put(bytes)` writes a mutant; the original comes back on exit
    (any exit: exception, KeyboardInterrupt, SIGTERM turned into one), its mtime too."""

    def __init__(self, path: Path):
        self.path = path
        self.backup = path.with_name(path.name + BACKUP_SUFFIX)

    def __enter__(self):
        restore_backup(self.path)
        self.original = self.path.read_bytes()
        self.stat = self.path.stat()
        self.backup.write_bytes(self.original)
        self.lock = self.path.with_name(self.path.name + LOCK_SUFFIX)
        self.lock.write_text(str(os.getpid()))
        self._old_handler = signal.signal(signal.SIGTERM, _raise_interrupt) \
            if _in_main_thread() else None
        return self.put

    def put(self, content: bytes) -> None:
        self.path.write_bytes(content)
        # a new mtime (the original's + 2 s) and PYTHONDONTWRITEBYTECODE: the original's .pyc never passes for it
        os.utime(self.path, ns=(self.stat.st_atime_ns, self.stat.st_mtime_ns + 2_000_000_000))

    def __exit__(self, *exc) -> None:
        self.path.write_bytes(self.original)
        os.utime(self.path, ns=(self.stat.st_atime_ns, self.stat.st_mtime_ns))
        self.backup.unlink(missing_ok=True)
        self.lock.unlink(missing_ok=True)
        if self._old_handler is not None:
            signal.signal(signal.SIGTERM, self._old_handler)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _in_main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


def _owner(path: Path) -> Optional[int]:
    """The pid of a live run that has `path` mutated now (its FILE.mutate-pid), else None."""
    lock = path.with_name(path.name + LOCK_SUFFIX)
    try:
        pid = int(lock.read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid if pid != os.getpid() else None


def restore_backup(path: Path) -> bool:
    """Put back a copy a killed run left (FILE.mutate-orig); True when there was one. Refuses (RuntimeError)
    while another live run has the file mutated."""
    backup = path.with_name(path.name + BACKUP_SUFFIX)
    owner = _owner(path)
    if owner is not None:
        raise RuntimeError(f"{path} is being mutated by another run (pid {owner}); wait for it or stop it")
    if backup.exists():
        path.write_bytes(backup.read_bytes())
        backup.unlink()
        path.with_name(path.name + LOCK_SUFFIX).unlink(missing_ok=True)
        print(f"restored {path} from {backup.name} (a previous run was killed)", file=sys.stderr)
        return True
    return False


def original_source(path: Path) -> bytes:
    """The file as it is without a mutant (the backup while a run has one on disk): for --list."""
    backup = path.with_name(path.name + BACKUP_SUFFIX)
    return backup.read_bytes() if backup.exists() else path.read_bytes()


def select(mutants: list[Mutant], sample: Optional[int], seed: int) -> list[Mutant]:
    if sample is None or sample >= len(mutants):
        return mutants
    return sorted(random.Random(seed).sample(mutants, sample), key=lambda m: (m.start, m.end, m.replacement))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.mutate", description=__doc__.split("\n\n")[0])
    parser.add_argument("file", help="the module to mutate, relative to the repository root")
    parser.add_argument("--tests", nargs="+", help="test files or node ids to run (default: COVERING, else the "
                                                   "test files importing the module)")
    parser.add_argument("--sample", type=int, help="run a seeded random sample of this many mutants")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, help="seconds per mutant (default: 3x the unmutated run, >= 60)")
    parser.add_argument("--list", action="store_true", help="print the mutants and the tests, run nothing")
    parser.add_argument("--only", nargs="+", help="run only these mutant ids")
    parser.add_argument("--lines", help="only mutants starting on lines A-B (a function of a large module)")
    parser.add_argument("--report", help="write the results as JSON here")
    parser.add_argument("--equivalents", default=str(EQUIVALENTS), help="the list of equivalent mutant ids")
    args = parser.parse_args(argv)

    path = str(Path(args.file))
    file = ROOT / path
    if not args.list:
        restore_backup(file)
    source = original_source(file)
    changed = subprocess.run(["git", "diff", "--quiet", "--", path], cwd=ROOT, capture_output=True).returncode
    if changed == 1:
        print(f"warning: {path} differs from git's HEAD: its mutants are of the file as it is now", file=sys.stderr)
    all_mutants = mutants_of(path, source)
    if args.lines:
        first, _, last = args.lines.partition("-")
        all_mutants = [m for m in all_mutants if int(first) <= m.line <= int(last or first)]
    equivalents = load_equivalents(Path(args.equivalents))
    chosen = select(all_mutants, args.sample, args.seed)
    if args.only:
        chosen = [m for m in all_mutants if m.id in set(args.only)]
    tests = args.tests or covering_tests(path)
    print(f"{path}: {len(all_mutants)} mutants, running {len(chosen)}"
          f"{f' (sample, seed {args.seed})' if args.sample and len(chosen) < len(all_mutants) else ''}; "
          f"tests: {' '.join(tests) or '(none)'}")
    if args.list:
        for m in chosen:
            print(f"{path}:{m.line} {m.id} {m.operator}: {m.original!r} -> {m.replacement!r}"
                  f"{'  [equivalent]' if m.id in equivalents else ''}")
        return 0
    if not tests:
        print("no tests cover this module: pass --tests", file=sys.stderr)
        return 2
    outcome, seconds = run_tests(tests, timeout=args.timeout or 1800)
    if outcome != "passed":
        print(f"the tests do not pass without a mutant ({outcome}): fix them first", file=sys.stderr)
        return 2
    timeout = args.timeout or max(60.0, 3 * seconds)
    print(f"unmutated: passed in {seconds:.0f} s; {timeout:.0f} s per mutant at most")
    results: list[dict] = []
    survivors: list[Mutant] = []
    counts = {"killed": 0, "timeout": 0, "survived": 0, "equivalent": 0}
    with MutatedFile(file) as put:
        for number, mutant in enumerate(chosen, 1):
            if mutant.id in equivalents:
                counts["equivalent"] += 1
                results.append({"id": mutant.id, "line": mutant.line, "outcome": "equivalent"})
                continue
            put(mutant.apply(source))
            outcome, seconds = run_tests(tests, timeout)
            status = {"failed": "killed", "timeout": "timeout", "passed": "survived"}[outcome]
            counts[status] += 1
            results.append({"id": mutant.id, "line": mutant.line, "operator": mutant.operator,
                            "original": mutant.original, "replacement": mutant.replacement, "outcome": status,
                            "seconds": round(seconds, 1)})
            print(f"[{number}/{len(chosen)}] {path}:{mutant.line} {mutant.id} {mutant.operator}: {status} "
                  f"({seconds:.0f} s)", flush=True)
            if status == "survived":
                survivors.append(mutant)
    if file.read_bytes() != source:
        print(f"{path} is not as it was before the run: restore it (git checkout)", file=sys.stderr)
        return 3
    counted = len(chosen) - counts["equivalent"]
    killed = counts["killed"] + counts["timeout"]
    score = killed / counted if counted else 1.0
    print(f"\n{path}: {len(chosen)} run, {killed} killed ({counts['timeout']} by timeout), "
          f"{counts['equivalent']} equivalent, {counts['survived']} survived: score {score:.0%}")
    for mutant in survivors:
        print(f"\nSURVIVED {path}:{mutant.line} {mutant.id} ({mutant.operator})\n{mutant.diff(source)}", end="")
    if args.report:
        Path(args.report).write_text(json.dumps({"file": path, "mutants": len(all_mutants), "run": len(chosen),
                                                 "sample": args.sample, "seed": args.seed, "tests": tests,
                                                 **counts, "score": score, "results": results}, indent=1))
    return 0 if not survivors else 1


if __name__ == "__main__":
    sys.exit(main())

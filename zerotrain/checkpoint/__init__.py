"""The unified checkpoint: one format for every topology, readable by Hugging Face.

`save_checkpoint(checkpointer, save_dir, tag, client_state, save_latest, async_save)` writes
`save_dir/<tag>/` (format: `zerotrain.checkpoint.format`) in parallel: tensors are
assigned to ranks balanced by bytes, each writer assembles whole tensors from the
pieces other ranks hold (`plan`, `write`), files go to a temporary directory that is
committed by a rename once every rank's files and the manifest are fsynced
(`commit`, `integrity`). With `async_save` the step blocks only while this rank's
pieces are copied to reusable host buffers (`snapshot`); a background thread
writes and commits (`checkpointer`). `load_checkpoint` reads it back onto any world
size, ZeRO stage and tensor-parallel degree, each rank reading only its slices (`load`, `reader`,
`source`, `split`); given a DeepSpeed ZeRO checkpoint directory it converts it first (`deepspeed_dir`).

The checkpoint never reads the engine: the engine hands it a `CheckpointState` (`slots`), a
fixed, declared set of state (slots, optimizer, counters, loss scaler, scheduler, LoCo buffers).

Public API: `save_checkpoint`, `load_checkpoint` (what the engine's methods call, with its
`CheckpointState`), `Checkpointer` (`engine.checkpointer`: `wait()`, `raise_if_failed()`, `pending`,
`last_stall_seconds`, `last_fence_seconds`: their sum is an async save's training stall),
`SnapshotFences` (the engine's fence: what writers of its slots wait on outside `engine.step()`),
`CheckpointError`, and the offline tools `inspect_checkpoint`, `verify_checkpoint`, `export_model`,
`latest_step`, `export_deepspeed`.

Modules, one concept each:
    format        file names, the streaming safetensors writer, CheckpointError
    directio      O_DIRECT writes and range reads through aligned buffers (measured there)
    integrity     manifest and crc32 checksums (why crc32: measured there)
    commit        temporary directories, atomic rename, `latest`, rotation, recovery of interrupted re-saves
    lock          one writer per save directory: the job that holds it, stale locks taken over
    plan          who writes what, in which file and round
    snapshot      the bytes a save reads, host buffers for async saves
    write         one save executed: exchange, write, agree, commit
    fence         pending async snapshot copies, waited for by whatever writes the slots next
    checkpointer  the engine's Checkpointer: async thread, error propagation
    source        which directory to load, what kind, intact or not
    slots         CheckpointState: what the engine hands the checkpoint (slots, optimizer, stateful objects)
    split         tensor-parallel slices: joined into whole tensors on save, read back out on load
    reader        tensor ranges by name, read as exact byte ranges
    load          validate everything, agree across ranks, then read into the CheckpointState
    optim_state   optimizer state keys, scalars, group hyperparameters
    state         trainer state and RNG as JSON
    tools         inspect / verify / export, for the `zerotrain ckpt` command
    deepspeed_dir DeepSpeed ZeRO checkpoint directories joined into whole tensors and written as a checkpoint
    deepspeed_export  a checkpoint written as a DeepSpeed ZeRO checkpoint directory for a chosen world size
    command       the `zerotrain ckpt inspect|verify|import|export` subcommands (argparse, output, exit codes)
"""
from __future__ import annotations

from .checkpointer import Checkpointer, save_checkpoint
from .slots import CheckpointState, LoCoState, Stateful
from .fence import SnapshotFences
from .format import CheckpointError
from .load import load_checkpoint
from .deepspeed_export import export_deepspeed
from .tools import export_model, inspect_checkpoint, intact_tags, latest_step, saved_config, verify_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "Checkpointer", "CheckpointState", "Stateful", "LoCoState", "CheckpointError", "SnapshotFences",
           "inspect_checkpoint", "verify_checkpoint", "export_model", "latest_step", "export_deepspeed", "intact_tags",
           "saved_config"]

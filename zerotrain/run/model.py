"""The model and engine of a `zerotrain train` run: the model of a resolved ``--model`` built for the run's config
(under ``zero.Init`` at ZeRO-3, LoRA adapters through peft), its engine (`zerotrain.initialize` handed the run's
parsed config), its directory's weights read shard by shard (with the vocabulary-growth overlay).

Each function takes the run's `RunConfig` (built once, `zerotrain.run.config`) or a config dict (read here).
"""
from __future__ import annotations

import argparse
import os
from typing import Optional, Union

from zerotrain.command import CLIError
from zerotrain.run.config import RunConfig

__all__ = ["model_engine", "train_model", "train_engine", "load_weights", "lora_options"]

ConfigArg = Union[RunConfig, dict]


def _values_and_parsed(config: ConfigArg):
    """(the config dict, the parsed config) of a `RunConfig` (no parse) or a dict (parsed here)."""
    if isinstance(config, RunConfig):
        return config.values, config.parsed
    from zerotrain.config import load_config
    return config, load_config(config)


def lora_options(args: argparse.Namespace):
    """--lora-* as ``zerotrain.models.hf.LoraOptions`` (None without --lora-r)."""
    if getattr(args, "lora_r", None) is None:
        return None
    from zerotrain.models.hf import LoraOptions

    targets = None
    if args.lora_target_modules:
        targets = tuple(name.strip() for name in args.lora_target_modules.split(",") if name.strip())
    return LoraOptions(r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout, target_modules=targets)


def model_engine(source, config: ConfigArg, seed: int = 0, lora=None):
    """``(engine, model)``: `train_model` under `train_engine` (the model of a resolved ``--model``,
    ``zerotrain.models.hf.ModelSource``); its directory's weights are not read yet (``engine.load_checkpoint(
    source.weights_dir, load_module_only=True)`` reads each rank's own shard ranges)."""
    model = train_model(source, config, seed=seed, lora=lora)
    return train_engine(model, config, lora), model


def train_model(source, config: ConfigArg, seed: int = 0, lora=None):
    """The model of a resolved ``--model`` for `config`, before any engine (weights not read yet).

    At ZeRO-3 the model is built inside ``zero.Init`` in the config's dtype: every module is partitioned as
    soon as it is built, so the whole model never exists on one rank. Elsewhere a model with weights to load
    is built in the config's dtype; a random init in fp32 (the engine casts it to the training dtype and copies its
    fp32 masters from the cast weights, as DeepSpeed does).
    With ``lora`` (``zerotrain.models.hf.LoraOptions``) peft wraps the model with LoRA adapters: only the
    adapters train; at ZeRO-3 the frozen base stays partitioned. A config with an ``activation_checkpointing``
    block (``--gradient-checkpointing``) turns on the model's gradient checkpointing with zerotrain's function.
    """
    import torch

    from zerotrain.models.hf import apply_lora, build_model
    from zerotrain.precision import training_dtype
    from zerotrain.zero import GatheredParameters, Init

    values, run_config = _values_and_parsed(config)
    dtype = training_dtype(run_config.precision)
    stage3 = run_config.zero_optimization.stage == 3
    init = Init(config=values, dtype=dtype, timeout_seconds=run_config.comm_timeout_seconds) if stage3 else None
    build_dtype = dtype if (stage3 or source.weights_dir is not None) else torch.float32
    model = build_model(source, build_dtype, init=init, seed=seed)
    if lora is not None:
        # peft reads the trainable-token rows of the embedding (and head) when it wraps them: gathered whole for
        # it at ZeRO-3 (their values do not matter: load_weights sets the rows from the weights it loads)
        embeddings = [m.weight for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]
        with GatheredParameters(embeddings, enabled=stage3 and bool(lora.trainable_tokens)):
            model = apply_lora(model, lora, base_dir=source.weights_dir, seed=seed)
    if "activation_checkpointing" in values:  # --gradient-checkpointing, or a file's block: the model's own layers
        from zerotrain.checkpointing import enable_hf_gradient_checkpointing
        enable_hf_gradient_checkpointing(model.get_base_model() if lora is not None else model)
    return model


def weight_decay_groups(model, weight_decay: float) -> list[dict]:
    """The HF Trainer's parameter groups for the optimizer it builds itself (`Trainer.create_optimizer`): weight decay
    on the trainable parameters transformers' `Trainer.get_decay_parameter_names` names, none on the others (biases,
    LayerNorm / RMSNorm weights); empty groups left out."""
    import transformers

    # an instance method that reads only the model: transformers' own rule, whatever its version
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for name, p in named if name in decay], "weight_decay": weight_decay},
              {"params": [p for name, p in named if name not in decay], "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def train_engine(model, config: ConfigArg, lora=None, decay_groups: bool = False):
    """``zerotrain.initialize`` of a `train_model` model; with ``lora`` every checkpoint also holds the adapter in
    PEFT's layout (gathered at each save: collective). ``decay_groups`` (the AdamW built from the flags,
    `zerotrain.train.flags.optimizer_from_flags`): the HF Trainer's groups (`weight_decay_groups`), no decay on
    biases and norm weights, where the weight decay is not 0 (with 0 one group, the same steps)."""
    import zerotrain

    if isinstance(config, RunConfig) and not config.scheduled:
        raise ValueError("train_engine: the run's schedule is not laid over its steps yet (RunConfig.schedule_over)")
    values = config.values if isinstance(config, RunConfig) else config
    weight_decay = ((values.get("optimizer") or {}).get("params") or {}).get("weight_decay", 0.0)
    groups = weight_decay_groups(model, weight_decay) if decay_groups and weight_decay else None
    # the run's parsed config itself: initialize neither parses it again nor re-resolves its batch
    engine, _, _, _ = zerotrain.initialize(model=model, config=config.parsed if isinstance(config, RunConfig)
                                           else config, model_parameters=groups)
    if lora is not None:
        from zerotrain.models.hf import adapter_files
        engine.add_checkpoint_files(lambda: adapter_files(engine.full_state_dict(trainable_only=True), model))
    return engine


def load_weights(engine, source, model, old_vocab: Optional[int] = None, save_dir: Optional[str] = None,
                 seed: int = 0) -> None:
    """Load the model directory's weights into ``engine``, each rank reading its own shard ranges.

    With ``old_vocab`` (``zerotrain.models.hf.grow_vocab`` grew the vocabulary, --add-tokens) the embedding and
    head grow to config.vocab_size: rank 0 writes the resized tensors as an overlay of the directory
    (``zerotrain.models.hf.write_resized``) where every rank reads it (``save_dir``; without one the temp
    directory, which must then be shared by the ranks), every rank loads from it, rank 0 removes it."""
    from zerotrain.models.hf import trained_token_rows, write_resized

    if old_vocab is None and not trained_token_rows(model):
        engine.load_checkpoint(source.weights_dir, load_module_only=True)
        return
    # the overlay also holds the rows LoRA's trainable tokens start from (the base rows, resized or not)
    old_vocab = old_vocab if old_vocab is not None else int(source.config.vocab_size)
    import shutil
    import tempfile
    import uuid

    from zerotrain.comm import Comm

    comm = Comm(None, engine.global_rank, engine.world_size)
    token = comm.all_gather_object(uuid.uuid4().hex[:12])[0]  # one name for the whole job
    overlay = os.path.join(save_dir or tempfile.gettempdir(), f".zerotrain-resized-{token}")
    error = None
    if engine.global_rank == 0:
        try:
            write_resized(source, model, old_vocab, overlay, seed=seed)
        except Exception as exc:  # noqa: BLE001 - every rank raises it below
            error = f"{type(exc).__name__}: {exc}"
    failed = [e for e in comm.all_gather_object(error) if e]
    if failed:
        raise CLIError(f"cannot resize the vocabulary of {source.weights_dir} (rank 0): {failed[0]}")
    try:
        engine.load_checkpoint(overlay, load_module_only=True)
    finally:
        comm.all_gather_object(None)  # every rank has read it
        if engine.global_rank == 0:
            shutil.rmtree(overlay, ignore_errors=True)



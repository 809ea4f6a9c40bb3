"""Ulysses sequence parallelism: each rank of a sequence-parallel group holds 1/N of every sequence.

Layers that act token by token (embeddings, norms, MLPs, the head, the loss) run on the local
shard unchanged. Attention needs the whole sequence: before it, an all-to-all turns this rank's
sequence shard of every head into the whole sequence of 1/N of the heads; attention runs on those
heads; a second all-to-all turns the result back into the sequence shard of every head
(`zerotrain.comm.all_to_all_with_grad`; its backward is the reverse exchange). Per layer and
rank that moves 4 (q, k, v, output) activations of (N-1)/N × local tokens × hidden, whatever N.

Wiring (`enable_sequence_parallel`, called by the engine when `sequence_parallel_size` > 1):

- zerotrain's GPT: its attention blocks take the `SequenceParallel` object and call
  `gather_heads` / `scatter_heads` around `scaled_dot_product_attention`; positions are the
  shard's global offsets; its loss is the mean over the group's tokens.
- Hugging Face causal LMs (Llama, Qwen2, Mistral, ...), not rewritten: as DeepSpeed's ALST does,
  the attention function transformers looks up in `ALL_ATTENTION_FUNCTIONS` under the model's
  `config._attn_implementation` is wrapped. The wrapper acts only for attention modules marked
  with this object (every other model in the process calls the original function). It drops the
  mask transformers built for the local shard (causality comes from the full-length call; packed
  documents from the gathered `position_ids`), replicates key/value heads when there are fewer
  per rank than N (grouped-query attention; ALST does the same), and calls the original function
  on the full sequence. A forward pre-hook supplies `position_ids` at the shard's global offsets
  when the caller gives none (rotary embeddings are applied before attention, per token), and a
  forward hook turns the model's loss (its sum over the shard divided by the group's token count,
  see `shard`) into the full-sequence mean on every rank.

Batches: `SequenceParallel.shard(batch)` takes the whole micro-batch (every rank of the group is
given the same samples) and returns this rank's slice: labels shifted once on the whole sequence
(`shift_labels`, as ALST), so no target is lost at a shard boundary; a length that does not divide
by N padded at the end (pad token 0, label -100, positions continuing), which leaves every real
token's output unchanged under causal attention; the group's count of real targets
(`num_items_in_batch`), so the loss is the mean over the true token count.

Gradients: the loss is summed over the group with `all_reduce_with_grad`, so each rank's gradient
is N × its share; ZeRO averages over the data × sequence ranks, which divides N back out
(DeepSpeed's Ulysses averages over the same ranks).

Facts from DeepSpeed 0.19.8 (`deepspeed/sequence/layer.py`, `runtime/sequence_parallel/ulysses_sp.py`);
the code is zerotrain's own.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm import Comm, all_reduce_with_grad, all_to_all_with_grad

__all__ = ["SequenceParallel", "check_sequence_parallel", "enable_sequence_parallel", "IGNORE_INDEX"]

IGNORE_INDEX = -100
_MARK = "_zerotrain_sequence_parallel"


def _head_counts(model: nn.Module) -> tuple[str, int, int]:
    """(kind, attention heads, key/value heads) of a model sequence parallelism can wrap."""
    from ..models.gpt import GPT

    if isinstance(model, GPT):
        return "gpt", int(model.config.n_head), int(model.config.n_head)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        text = config.get_text_config()
        heads = getattr(text, "num_attention_heads", None)
        if heads is not None:
            kv = getattr(text, "num_key_value_heads", None) or heads
            return "hf", int(heads), int(kv)
    raise ValueError(f"sequence_parallel_size > 1 needs zerotrain's GPT or a Hugging Face model whose config names "
                     f"num_attention_heads; got {type(model).__name__}")


def check_sequence_parallel(model: nn.Module, sp_size: int, tp_size: int = 1) -> None:
    """Refuse, before any process group exists, a model whose heads cannot be split over tp × sp ranks."""
    if sp_size == 1:
        return
    _, heads, kv = _head_counts(model)
    name = type(model).__name__
    if heads % (tp_size * sp_size):
        raise ValueError(f"sequence_parallel_size: {sp_size} x tensor_parallel.autotp_size: {tp_size} = "
                         f"{tp_size * sp_size} does not divide the {heads} attention heads of {name}: each "
                         "sequence-parallel rank attends over whole heads")
    local_kv = kv // tp_size if kv % tp_size == 0 else None
    if local_kv is None or not (local_kv % sp_size == 0 or sp_size % local_kv == 0):
        raise ValueError(f"sequence_parallel_size: {sp_size}: the {kv} key/value heads of {name} "
                         f"(per tensor-parallel rank: {kv}/{tp_size}) neither divide by it nor divide it, so they "
                         "can be neither split nor replicated over the sequence-parallel ranks")


class SequenceParallel:
    """One rank's view of its sequence-parallel group: the exchanges, positions, batch slicing, loss."""

    def __init__(self, comm: Comm):
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self._positions: Optional[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]] = None

    # --- the exchanges -------------------------------------------------------------------
    def gather_heads(self, x: torch.Tensor, head_dim: int = 1, seq_dim: int = 2) -> torch.Tensor:
        """Sequence shard of every head -> whole sequence of 1/N of the heads."""
        return all_to_all_with_grad(self.comm, x, scatter_dim=head_dim, gather_dim=seq_dim)

    def scatter_heads(self, x: torch.Tensor, head_dim: int = 1, seq_dim: int = 2) -> torch.Tensor:
        """Whole sequence of 1/N of the heads -> sequence shard of every head (the inverse)."""
        return all_to_all_with_grad(self.comm, x, scatter_dim=seq_dim, gather_dim=head_dim)

    # --- positions ---------------------------------------------------------------------------
    def local_positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """The global positions of this rank's shard of an unpacked sequence: (1, local_len)."""
        return (torch.arange(local_len, device=device) + self.rank * local_len).unsqueeze(0)

    def full_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Every rank's (B, S/N) positions joined into (B, S) (no gradient: they are indices)."""
        local = position_ids.contiguous()
        gathered = local.new_empty((self.size * local.shape[0], *local.shape[1:]))
        self.comm.all_gather(gathered, local)
        return gathered.view(self.size, *local.shape).movedim(0, -2).reshape(local.shape[0], -1)

    def gathered_positions(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(whole-sequence positions (B, S), mask): the mask is None for unpacked sequences (plain causal
        attention); for packed ones (positions restart at a document boundary) the (B, 1, S, S) boolean
        mask of causal attention within each document. Computed once per forward (every layer is handed
        the same position tensor, so all ranks of the group hit or miss this cache together)."""
        cached = self._positions
        if cached is not None and cached[0] is position_ids:
            return cached[1], cached[2]
        full = self.full_positions(position_ids)
        starts = full[:, 1:] != full[:, :-1] + 1
        mask = None
        # (meta tensors, `zerotrain estimate`'s shapes-only forward, hold no positions: read as unpacked)
        if not full.is_meta and bool(starts.any()):
            documents = torch.cat([torch.zeros_like(starts[:, :1]), starts], dim=1).cumsum(dim=1)
            length = full.shape[1]
            causal = torch.ones(length, length, dtype=torch.bool, device=full.device).tril()
            mask = (causal & (documents[:, :, None] == documents[:, None, :])).unsqueeze(1)
        self._positions = (position_ids, full, mask)
        return full, mask

    # --- batches -------------------------------------------------------------------------
    def shard(self, batch: dict, *, shift_labels: bool = True, pad_token_id: int = 0) -> dict:
        """This rank's slice of a whole micro-batch (see the module doc).

        `batch`: `input_ids` (B, S), optionally `labels` (B, S) (-100 ignored), `position_ids` (per-document
        positions of packed sequences; default 0..S-1) and `attention_mask` (2-D right padding only: pads
        after the real tokens, with labels -100; it is not passed on, causal attention needs none). `shift_labels=False` when
        `labels` already hold each token's target (zerotrain's GPT: y = x shifted by the data).
        Returns `input_ids`, `position_ids`, and with labels `labels` and `shift_labels` (the same
        shifted local targets) and `num_items_in_batch` (the real targets of the whole micro-batch)."""
        input_ids = batch["input_ids"]
        if input_ids.dim() != 2:
            raise ValueError(f"sequence parallelism: input_ids must be (batch, seq), got {tuple(input_ids.shape)}")
        rows, length = input_ids.shape
        mask = batch.get("attention_mask")
        if mask is not None:
            # right padding (pads after every real token, labels -100) is harmless under causal attention
            if mask.dim() != 2 or bool((mask[:, 1:] > mask[:, :-1]).any()):
                raise ValueError("sequence parallelism: attention_mask must be a 2-D right-padding mask (pads after the "
                                 "real tokens, labels -100); for packed sequences pass per-document position_ids, "
                                 f"not a {mask.dim()}-D mask")
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(length, device=input_ids.device).expand(rows, length)
        labels = batch.get("labels")
        targets = None
        if labels is not None:
            targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX) if shift_labels else labels
        pad = (-length) % self.size
        if pad:
            input_ids = F.pad(input_ids, (0, pad), value=pad_token_id)
            steps = torch.arange(1, pad + 1, device=positions.device)
            positions = torch.cat([positions, positions[:, -1:] + steps], dim=1)
            if targets is not None:
                targets = F.pad(targets, (0, pad), value=IGNORE_INDEX)
        local = (length + pad) // self.size
        piece = slice(self.rank * local, (self.rank + 1) * local)
        out = {"input_ids": input_ids[:, piece].contiguous(), "position_ids": positions[:, piece].contiguous()}
        if targets is not None:
            out["labels"] = out["shift_labels"] = targets[:, piece].contiguous()
            out["num_items_in_batch"] = (targets != IGNORE_INDEX).sum()
        return out

    # --- the loss ------------------------------------------------------------------------
    def mean_loss(self, loss_sum: torch.Tensor, count: Optional[torch.Tensor] = None,
                  num_items: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The group's mean loss on every rank: (sum over the group of each rank's `loss_sum`) / tokens.
        The token count is `num_items` (the whole micro-batch's, known to every rank) or the group's sum of
        `count`."""
        if num_items is None:
            total = count.detach().to(torch.float32).clone()
            self.comm.all_reduce(total)
        else:
            total = num_items.detach().to(torch.float32)
        return all_reduce_with_grad(self.comm, loss_sum) / total.clamp(min=1)

    def causal_lm_loss(self, logits: torch.Tensor, shift_labels: torch.Tensor,
                       num_items_in_batch: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Cross entropy of this shard's logits against its (already shifted) targets, averaged over the
        group's real targets: the same value as one process on the whole sequences."""
        targets = shift_labels.reshape(-1).to(logits.device).long()
        loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets,
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        return self.mean_loss(loss_sum, (targets != IGNORE_INDEX).sum(), num_items_in_batch)

    # --- Hugging Face attention ------------------------------------------------------------
    def hf_attention(self, original: Callable, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: Any, *args: Any, **kwargs: Any):
        """transformers' attention call on (B, heads, S/N, D) tensors, run on the whole sequence of 1/N of
        the heads; returns ((B, S/N, heads, D), None) as the attention functions do."""
        positions = kwargs.get("position_ids")
        if positions is None:
            raise ValueError("sequence parallelism: the attention call got no position_ids; pass the batch through "
                             "engine.sequence_parallel.shard(batch)")
        heads, kv_heads = query.shape[1], key.shape[1]
        if kv_heads % self.size:  # fewer key/value heads than ranks: each rank gets a copy of its group's head
            repeat = self.size // kv_heads
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        query, key, value = self.gather_heads(query), self.gather_heads(key), self.gather_heads(value)
        kwargs["position_ids"], mask = self.gathered_positions(positions)
        window = kwargs.get("sliding_window")
        if window is not None and query.shape[2] > window:  # the whole-sequence mask below is causal only
            raise ValueError(f"sequence parallelism does not apply sliding-window attention: the model's "
                             f"sliding_window is {window} and the sequence has {query.shape[2]} tokens; use "
                             f"sequences of at most {window} tokens or sequence_parallel_size 1")
        groups = getattr(module, "num_key_value_groups", None)
        if groups is not None:
            module.num_key_value_groups = query.shape[1] // key.shape[1]
        try:
            output, _ = original(module, query, key, value, mask, *args, **kwargs)
        finally:
            if groups is not None:
                module.num_key_value_groups = groups
        # (B, S, heads/N, D) -> (B, S/N, heads, D)
        return self.scatter_heads(output.contiguous(), head_dim=2, seq_dim=1), None


def _wrap_attention_function(implementation: str) -> None:
    """Put the Ulysses wrapper in front of transformers' attention function `implementation` (once)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if implementation not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"sequence parallelism wraps transformers' attention functions "
                         f"{sorted(ALL_ATTENTION_FUNCTIONS.valid_keys())}; this model uses {implementation!r}")
    original = ALL_ATTENTION_FUNCTIONS[implementation]
    if getattr(original, _MARK, False):
        return

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        sp = getattr(module, _MARK, None)
        if sp is None:
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        return sp.hf_attention(original, module, query, key, value, attention_mask, *args, **kwargs)

    setattr(attention, _MARK, True)
    ALL_ATTENTION_FUNCTIONS[implementation] = attention


def _enable_hf(model: nn.Module, sp: SequenceParallel) -> None:
    config = model.config
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation == "eager":  # eager is not in the registry: use sdpa, the same math
        model.set_attn_implementation("sdpa")
        implementation = "sdpa"
    _wrap_attention_function(implementation)
    marked = 0
    for module in model.modules():
        if hasattr(module, "num_key_value_groups") and hasattr(module, "head_dim"):
            setattr(module, _MARK, sp)
            marked += 1
    if not marked:
        raise ValueError(f"sequence parallelism found no attention module (with num_key_value_groups and head_dim) "
                         f"in {type(model).__name__}")

    def positions(module, args, kwargs):
        kwargs.setdefault("use_cache", False)  # training; with a cache transformers attends across packed documents
        if kwargs.get("position_ids") is None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is None:
                ids = kwargs["inputs_embeds"]
            kwargs["position_ids"] = sp.local_positions(ids.shape[1], ids.device)
        if kwargs.get("labels") is not None and (kwargs.get("shift_labels") is None
                                                 or kwargs.get("num_items_in_batch") is None):
            raise ValueError("sequence parallelism: labels given without shift_labels and num_items_in_batch would "
                             "lose the target at each shard boundary and average per shard; pass the batch through "
                             "engine.sequence_parallel.shard(batch)")
        return args, kwargs

    def group_mean(module, args, kwargs, output):
        loss = getattr(output, "loss", None)
        if loss is not None and kwargs.get("labels") is not None:
            output.loss = all_reduce_with_grad(sp.comm, loss)  # each shard's sum / the group's count
        return output

    model.register_forward_pre_hook(positions, with_kwargs=True)
    model.register_forward_hook(group_mean, with_kwargs=True)


def enable_sequence_parallel(model: nn.Module, comm: Comm, tp_size: int = 1) -> SequenceParallel:
    """Make `model` run Ulysses sequence parallelism over `comm` (its sequence-parallel group)."""
    check_sequence_parallel(model, comm.size, tp_size)
    sp = SequenceParallel(comm)
    kind, _, _ = _head_counts(model)
    if kind == "gpt":
        model.sequence_parallel = sp
        for block in model.transformer.h:
            block.attn.sequence_parallel = sp
    else:
        _enable_hf(model, sp)
    return sp

"""One merge run, streamed: check the inputs agree, then merge and write one tensor at a time.

Before anything is written, every input's header is read and compared: the key sets
(after `include` / `exclude`, which drop keys from the output), the shapes, and the
vocabulary sizes; every error names the tensor and the files at fault. Then each
output tensor is read from every input in fp32, merged (`methods`), cast to the
output dtype (the source dtype unless `dtype` is set) and written (`writer`) before the
next one is read, so the peak memory is that of one tensor's inputs and temporaries.
`max_memory` is checked against that per-tensor working set up front.

The output directory gets config.json, generation_config.json and the tokenizer files
of the tokenizer source (the base model, else the first model), and `merge_config.json`
recording the method, the inputs with their files' checksums, and every parameter.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import torch

from ..version import __version__ as zerotrain_version
from ..checkpoint.format import HF_CONFIG, numel_of
from . import methods
from .errors import MergeError
from .recipe import METHODS, ModelSpec, Recipe, count_layers, layer_position, resolve_param
from .source import TensorSource
from .writer import ShardedWriter

MERGE_CONFIG = "merge_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "vocab.txt",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "generation_config.json")
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}
# The fp32 working set of one output tensor, in tensor sizes: one copy per input (its delta) plus
# the vote, sum, divisor, the trim/mask temporaries of one delta, topk's workspace and the
# allocator's slack. Measured: a TIES merge of 3 inputs peaked at about 14 tensor sizes of
# anonymous memory (tests/merge/test_memory.py checks the real growth stays below this bound).
WORKING_COPIES_PER_INPUT = 1
WORKING_COPIES_FIXED = 13


def _out_dtype(recipe: Recipe) -> Optional[torch.dtype]:
    if recipe.dtype is None:
        return None
    try:
        return _DTYPES[str(recipe.dtype).replace("torch.", "")]
    except KeyError:
        raise MergeError(f"unknown output dtype {recipe.dtype!r} (bf16, fp16 or fp32)") from None


class _Inputs:
    """The opened sources: one per distinct input (the base may also be listed among the models)."""

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        specs = [m.path for m in recipe.models]
        if recipe.method == "lora" and recipe.models[0].params.get("adapter"):
            specs = [f"{recipe.models[0].path}+{recipe.models[0].params['adapter']}"]
        self.by_spec: dict[str, TensorSource] = {}
        try:
            for spec in ([recipe.base] if recipe.base else []) + specs:
                key = os.path.abspath(spec)
                if key not in self.by_spec:
                    self.by_spec[key] = TensorSource(spec)
        except BaseException:
            self.close()
            raise
        self.models = [self.by_spec[os.path.abspath(s)] for s in specs]
        self.base = self.by_spec[os.path.abspath(recipe.base)] if recipe.base else None
        if recipe.method == "lora" and self.models[0].adapter is None:
            raise MergeError("method lora needs an adapter: --param adapter=ADAPTER_DIR or a model given as "
                             "DIR+ADAPTER_DIR")
        others = [id(spec) for spec in recipe.others()]
        self.others = [(spec, source) for spec, source in zip(recipe.models, self.models) if id(spec) in others]
        self.reference = self.base or self.models[0]

    def all(self) -> list[TensorSource]:
        return list(self.by_spec.values())

    def close(self) -> None:
        for source in self.by_spec.values():
            source.close()


def select_keys(names: list[str], include: Optional[str], exclude: Optional[str]) -> list[str]:
    """The names kept: matching `include` (re.search) if given, and not matching `exclude`."""
    inc = re.compile(include) if include else None
    exc = re.compile(exclude) if exclude else None
    return [n for n in names if (inc is None or inc.search(n)) and (exc is None or not exc.search(n))]


def _check_keys(inputs: _Inputs, recipe: Recipe) -> list[str]:
    reference = inputs.reference
    names = select_keys(reference.keys(), recipe.include, recipe.exclude)
    if not names:
        raise MergeError(f"no tensor of {reference.path} is left after --include {recipe.include!r} / "
                         f"--exclude {recipe.exclude!r}")
    wanted = set(names)
    for source in inputs.all():
        if source is reference:
            continue
        have = set(select_keys(source.keys(), recipe.include, recipe.exclude))
        missing = sorted(wanted - have)
        if missing:
            raise MergeError(f"tensor {missing[0]!r} (from {reference.file_of(missing[0])}) is missing from "
                             f"{source.path}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        extra = sorted(have - wanted)
        if extra:
            raise MergeError(f"tensor {extra[0]!r} in {source.file_of(extra[0])} is not in {reference.path}"
                             + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    return names


class _Vocab:
    """Vocabulary-size policy: tensors whose first dimension is each model's vocabulary size."""

    def __init__(self, inputs: _Inputs, recipe: Recipe):
        self.sizes = {id(s): s.vocab_size() for s in inputs.all()}
        self.target: Optional[TensorSource] = None
        distinct = {v for v in self.sizes.values() if v is not None}
        self.mismatch = len(distinct) > 1
        if recipe.tokenizer_source is not None:
            self.target = _tokenizer_source(inputs, recipe.tokenizer_source)

    def rows(self, source: TensorSource) -> Optional[int]:
        return self.sizes[id(source)]

    def is_vocab_tensor(self, shapes: list[tuple[TensorSource, tuple]]) -> bool:
        if not self.mismatch:
            return False
        rest = {shape[1:] for _, shape in shapes}
        return len(rest) == 1 and all(shape and shape[0] == self.rows(s) for s, shape in shapes)


def _tokenizer_source(inputs: _Inputs, choice: str) -> TensorSource:
    if choice == "base":
        if inputs.base is None:
            raise MergeError("--tokenizer-source base needs a base model")
        return inputs.base
    for source in inputs.all():
        if os.path.abspath(choice) in (os.path.abspath(source.spec), os.path.abspath(source.path)):
            return source
    raise MergeError(f"--tokenizer-source {choice!r} is neither 'base' nor one of the input models "
                     f"{[s.spec for s in inputs.all()]}")


def _plan(inputs: _Inputs, recipe: Recipe, names: list[str], vocab: _Vocab) -> list[tuple[str, torch.dtype, tuple]]:
    out_dtype = _out_dtype(recipe)
    entries = []
    for name in names:
        dtype, shape = inputs.reference.entry(name)
        shapes = [(s, s.entry(name)[1]) for s in inputs.all()]
        if any(other != shape for _, other in shapes):
            if vocab.is_vocab_tensor(shapes):
                if vocab.target is None:
                    sizes = ", ".join(f"{s.path}: {vocab.rows(s)}" for s in inputs.all())
                    raise MergeError(f"vocabulary sizes differ ({sizes}; tensor {name!r}); choose the output "
                                     f"vocabulary with --tokenizer-source base|MODEL_DIR")
                shape = (vocab.rows(vocab.target),) + tuple(shape[1:])
            else:
                odd = next(s for s, other in shapes if other != shape)
                raise MergeError(f"tensor {name!r} has shape {list(shape)} in {inputs.reference.file_of(name)} but "
                                 f"{list(odd.entry(name)[1])} in {odd.file_of(name)}")
        if out_dtype is not None and dtype.is_floating_point:
            dtype = out_dtype
        entries.append((name, dtype, tuple(shape)))
    return entries


def _check_memory(recipe: Recipe, inputs: _Inputs, entries: list) -> int:
    """The largest per-tensor working set in bytes; raises when it exceeds `max_memory`."""
    count = len(inputs.others) + 1 if _uses_base(recipe) else len(inputs.models)
    worst, worst_name = 0, None
    for name, dtype, shape in entries:
        need = (WORKING_COPIES_PER_INPUT * count + WORKING_COPIES_FIXED) * numel_of(shape) * 4
        if need > worst:
            worst, worst_name = need, name
    if recipe.max_memory is not None and worst > recipe.max_memory:
        raise MergeError(f"tensor {worst_name!r} needs about {worst / 2**20:.0f} MiB to merge {count} inputs in fp32, "
                         f"more than --max-memory {recipe.max_memory / 2**20:.0f} MiB")
    return worst


def _uses_base(recipe: Recipe) -> bool:
    return METHODS[recipe.method][0]


def _fit_rows(tensor: torch.Tensor, rows: int, filler: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A vocabulary tensor cut or extended to `rows` rows (missing rows from the tokenizer source's model)."""
    if tensor.shape[0] == rows:
        return tensor
    if tensor.shape[0] > rows:
        return tensor[:rows]
    return torch.cat([tensor, filler()[tensor.shape[0]:rows]])


def _seed(seed: int, name: str, index: int) -> int:
    """A DARE mask seed that depends on the tensor and the model, not on the order tensors are merged in."""
    return zlib.crc32(f"{int(seed)}/{index}/{name}".encode())


def combine(recipe: Recipe, name: str, position: float, base: Optional[torch.Tensor],
            others: list[tuple[ModelSpec, torch.Tensor]]) -> torch.Tensor:
    """The merged fp32 tensor `name` from the base and the other inputs' fp32 tensors."""
    method = recipe.method

    def param(model: Optional[ModelSpec], key: str):
        return resolve_param(recipe, model, key, name, position)

    if method == "lora":
        return others[0][1]
    if method == "linear":
        return methods.linear([t for _, t in others], [float(param(m, "weight")) for m, _ in others],
                              normalize=bool(param(None, "normalize")))
    if method == "slerp":
        t = param(None, "t")
        if t is None:
            raise MergeError("slerp needs parameter t (--param t=0.5, or a list over the layers)")
        return methods.slerp(float(t), base, others[0][1])
    weights = [float(param(m, "weight")) for m, _ in others]
    deltas = []
    for index, (model, tensor) in enumerate(others):
        # not in place: an fp32 input may be a view of the memory-mapped file, and writing it would
        # turn those file pages into private anonymous copies that live as long as the mapping
        others[index] = (model, None)
        delta = tensor - base
        del tensor
        density = float(param(model, "density") if method != "task_arithmetic" else 1.0)
        if not 0 < density <= 1:
            raise MergeError(f"density {density} for {model.path} ({name!r}) is outside (0, 1]")
        if method == "ties":
            delta = methods.magnitude_prune(delta, density)
        elif method in ("dare_linear", "dare_ties") and density < 1:
            generator = torch.Generator().manual_seed(_seed(param(None, "seed"), name, index))
            mask = methods.bernoulli_mask(delta.shape, density, generator)
            delta = methods.dare_drop(delta, density, mask, rescale=bool(param(None, "rescale")))
            del mask
        deltas.append(delta)
        del delta
    consensus = param(None, "consensus") if method in ("ties", "dare_ties") else None
    return methods.task_vector_merge(base, deltas, weights, consensus, normalize=bool(param(None, "normalize")),
                                     lam=float(param(None, "lambda")))


def merge(recipe: Recipe, out: str, log: Optional[Callable[[str], None]] = None) -> dict:
    """Run the merge described by `recipe` into the new directory `out`; returns the merge_config record."""
    started = time.perf_counter()
    inputs = _Inputs(recipe)
    writer = None
    # The inputs' crc32s (merge_config.json's provenance) are taken on a thread while the merge runs: zlib
    # releases the GIL, and the files are read from the page cache the merge itself fills.
    checksummer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerotrain-merge-crc")
    checksums = checksummer.submit(lambda: [source.checksums() for source in inputs.all()])
    try:
        names = _check_keys(inputs, recipe)
        vocab = _Vocab(inputs, recipe)
        entries = _plan(inputs, recipe, names, vocab)
        working_set = _check_memory(recipe, inputs, entries)
        num_layers = count_layers(names, inputs.reference.config)
        writer = ShardedWriter(out, entries, recipe.shard_size)
        for name, dtype, shape in entries:
            position = layer_position(name, num_layers)
            stored, _ = inputs.reference.entry(name)
            if not stored.is_floating_point:
                writer.write(name, inputs.reference.read(name))  # integer buffers are copied, not merged
                continue

            def read(source: TensorSource) -> torch.Tensor:
                tensor = source.read(name)
                if tuple(tensor.shape) != tuple(shape):
                    tensor = _fit_rows(tensor, shape[0], lambda: vocab.target.read(name))
                return tensor

            base = read(inputs.base) if _uses_base(recipe) else None
            if not _uses_base(recipe):
                others = [(spec, read(source)) for spec, source in zip(recipe.models, inputs.models)]
            else:
                others = [(spec, read(source)) for spec, source in inputs.others]
            result = combine(recipe, name, position, base, others)
            del base, others
            writer.write(name, result.to(dtype))
            del result
        _copy_side_files(inputs, recipe, writer.directory, entries)
        record = {
            "zerotrain_version": zerotrain_version, **recipe.to_json(),
            "inputs": [{"model": s.spec, "path": s.path, "kind": s.kind,
                        "adapter": None if s.adapter is None else s.adapter.directory,
                        "checksums": crc} for s, crc in zip(inputs.all(), checksums.result())],
            "tensors": len(entries), "total_size": writer.total_size, "num_layers": num_layers,
            "working_set_bytes": working_set,
        }
        with open(os.path.join(writer.directory, MERGE_CONFIG), "w") as handle:
            json.dump(record, handle, indent=1)
        path = writer.commit()
        writer = None
        if log:
            log(f"merged {len(entries)} tensors ({record['total_size'] / 2**20:.1f} MiB) with {recipe.method} "
                f"into {path} in {time.perf_counter() - started:.1f} s")
        return record
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        checksums.cancel()
        checksummer.shutdown(wait=True)
        inputs.close()


def _copy_side_files(inputs: _Inputs, recipe: Recipe, directory: str, entries: list) -> None:
    """config.json (dtype and vocab size updated) and the tokenizer files of the tokenizer source."""
    source = (_tokenizer_source(inputs, recipe.tokenizer_source) if recipe.tokenizer_source is not None
              else inputs.reference)
    for file in TOKENIZER_FILES:
        path = os.path.join(source.path, file)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(directory, file))
    if source.config:
        config = dict(source.config)
        out_dtype = _out_dtype(recipe)
        if out_dtype is not None:
            key = "torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"
            config[key] = str(out_dtype).replace("torch.", "")
        with open(os.path.join(directory, HF_CONFIG), "w") as handle:
            json.dump(config, handle, indent=2)

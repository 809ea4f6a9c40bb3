"""What a load's readers do to the files and the page cache (in-process): the small tensors' pages asked for ahead
of the plan's reads, and nothing else (issue #48, round 7: `reader.prefetch_small_tensors`)."""
from __future__ import annotations

import ctypes
import mmap
import os
import time

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from zerotrain.checkpoint.format import read_layout
from zerotrain.checkpoint.reader import SMALL_TENSOR_BYTES, prefetch_small_tensors


def _resident_pages(path: str) -> set[int]:
    """The pages of `path` in the page cache (mincore(2) over a read-only mapping of the file)."""
    size = os.path.getsize(path)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_READ) as mapped:
        view = np.frombuffer(mapped, dtype=np.uint8)
        pages = (ctypes.c_ubyte * (-(-size // mmap.PAGESIZE)))()
        failed = libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), pages)
        del view  # no view of the mapping may outlive it
    if failed:
        pytest.skip(f"mincore: {os.strerror(ctypes.get_errno())}")
    return {index for index, flag in enumerate(pages) if flag & 1}


def test_prefetch_asks_the_kernel_for_exactly_the_small_tensors_pages(tmp_path):
    # A load reads optimizer scalars (Adam's `step`, one per parameter) one by one while it plans: their pages are
    # asked for ahead (POSIX_FADV_WILLNEED). Only theirs: not a large tensor's, not the whole file after an empty
    # tensor (a zero length means "to the end of the file" to the kernel), and at the tensor's own offset.
    page = mmap.PAGESIZE
    tensors = {"a/exp_avg": torch.randn(16 * page), "b/empty": torch.zeros(0), "b/step": torch.tensor(3.0),
               "c/exp_avg_sq": torch.randn(16 * page)}
    path = str(tmp_path / "optimizer-00001-of-00001.safetensors")
    save_file(tensors, path)
    header, data_start = read_layout(path)
    spans = {name: (data_start + entry["data_offsets"][0], data_start + entry["data_offsets"][1])
             for name, entry in header.items()}
    assert spans["a/exp_avg"][1] <= spans["b/step"][0] and spans["b/empty"][0] <= spans["c/exp_avg_sq"][0]
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if _resident_pages(path):
        pytest.skip("this filesystem keeps the file's pages in memory (tmpfs?): nothing to observe")
    read_layout(path)  # the header's read (prefetch reads it too) brings its pages and the kernel's readahead
    header_pages = _resident_pages(path)
    step = spans["b/step"][0] // page
    assert step not in header_pages and len(header_pages) < 8, sorted(header_pages)
    prefetch_small_tensors(str(tmp_path), ["optimizer-00001-of-00001.safetensors", "missing.safetensors"])
    deadline = time.monotonic() + 10
    while step not in _resident_pages(path) and time.monotonic() < deadline:
        time.sleep(0.05)  # the kernel reads ahead in the background
    resident = _resident_pages(path)
    assert step in resident, "the step's page was not read ahead"
    small = {index for begin, end in spans.values() if 0 < end - begin <= SMALL_TENSOR_BYTES
             for index in range(begin // page, (end - 1) // page + 1)}
    assert resident - header_pages == small - header_pages, (sorted(resident), sorted(small))


def test_a_range_past_a_tensors_end_is_refused_not_read_from_the_next_tensor(tmp_path):
    # elements [start, start + count) of a tensor stored before another: a range running past its end would read
    # the next tensor's bytes; it is refused naming the tensor and the file, as a start before 0 or a destination
    # of another size is, and the last element on its own is read
    from zerotrain.checkpoint.format import CheckpointError
    from zerotrain.checkpoint.reader import TensorReader
    save_file({"a": torch.arange(10, dtype=torch.float32), "b": torch.arange(100, 110, dtype=torch.float32)},
              str(tmp_path / "t.safetensors"))
    with TensorReader(str(tmp_path), {"a": "t.safetensors", "b": "t.safetensors"}, "model weights") as reader:
        assert torch.equal(reader.read_range("a", 9, 1), torch.tensor([9.0]))
        for start, count, target in ((9, 2, torch.empty(2)), (0, 11, torch.empty(11)), (-1, 1, torch.empty(1)),
                                     (0, 3, torch.empty(4)), (8, 3, torch.empty(3, dtype=torch.float64))):
            with pytest.raises(CheckpointError, match=r"tensor 'a' in .*t\.safetensors: elements .* do not fit"):
                reader.read_into("a", start, count, target)


def test_a_checked_read_lands_only_in_a_contiguous_cpu_tensor_of_the_stored_dtype(tmp_path):
    # `read_checked` is the copy itself (the file's bytes land in the destination's memory): a destination of
    # another dtype, strided, or on another device (meta stands in for an accelerator here) is refused naming the
    # tensor before anything is read; the load reads those through `read_into` instead
    from zerotrain.checkpoint.format import CheckpointError
    from zerotrain.checkpoint.reader import TensorReader
    values = torch.arange(12, dtype=torch.float16)
    save_file({"h": values}, str(tmp_path / "o.safetensors"))
    with TensorReader(str(tmp_path), {"h": "o.safetensors"}, "optimizer states") as reader:
        target = torch.zeros(4, dtype=torch.float16)
        pieces = reader.read_checked("h", 8, 4, target, [])
        assert torch.equal(target, values[8:]) and pieces == []
        for other in (torch.zeros(4), torch.zeros(8, dtype=torch.float16)[::2],
                      torch.zeros(4, dtype=torch.float16, device="meta")):
            assert not reader.can_read_checked("h", other)
            with pytest.raises(CheckpointError, match=r"tensor 'h' in .*o\.safetensors: elements \[8, 12\) do not fit"):
                reader.read_checked("h", 8, 4, other, [])

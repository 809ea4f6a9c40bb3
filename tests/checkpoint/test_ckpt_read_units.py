"""What a load's readers do (in-process, issue #48 round 7): the small tensors' pages asked for ahead of the plan's
reads and nothing else (`reader.prefetch_small_tensors`), ranges and destinations refused naming the tensor, and the
checksum shares of the bytes nobody reads straight in: every byte once, balanced against what each rank reads
(`integrity.balanced_share`) at worlds 1, 2 and 3."""
from __future__ import annotations

import ctypes
import mmap
import os
import time
import zlib

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from zerotrain.checkpoint.format import fsync_file, read_layout
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
    fsync_file(path)  # durable first: the kernel drops only clean pages
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
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


def test_balanced_shares_cover_every_byte_once_and_level_the_ranks_at_worlds_1_2_3(tmp_path):
    # the bytes nobody reads straight into a tensor are shared out so that each rank's direct reads plus its share
    # come out level (within a byte): the ranks' shares tile [0, total) in rank order, a rank below the level takes
    # it up to it, a rank above it takes nothing; and the pieces of those shares join into the file's crc32
    from zerotrain.checkpoint.integrity import Intervals, balanced_share, check_pieces, checksum_share
    rng = np.random.default_rng(7)
    cases = [(world, total, [int(x) for x in rng.integers(0, high, world)])
             for world in (1, 2, 3) for total in (0, 1, 2, 5, 1000, 4097) for high in (1, 3, 50, 5000)]
    cases += [(3, 10, [0, 0, 0]), (3, 2, [0, 0, 0]), (2, 7, [7, 0]), (3, 9, [0, 1, 2])]
    for world, total, loads in cases:
        shares = [balanced_share(total, rank, loads) for rank in range(world)]
        assert shares[0][0] == 0 and shares[-1][1] == total, (total, loads, shares)
        assert all(low <= high for low, high in shares) and all(
            shares[rank][1] == shares[rank + 1][0] for rank in range(world - 1)), (total, loads, shares)
        fills = [load + high - low for load, (low, high) in zip(loads, shares)]
        taking = [fill for fill, (low, high) in zip(fills, shares) if high > low]
        if taking:
            level = max(taking)
            assert min(taking) >= level - 1, (total, loads, shares)  # level within a byte
            assert all(load >= level - 1 for load, (low, high) in zip(loads, shares) if high == low), (total, loads)
    data = bytes(range(256)) * 40 + b"tail"
    (tmp_path / "f").write_bytes(data)
    manifest = {"files": {"f": {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}}}
    direct = [(0, 3000), (6000, 6100)]  # read straight in (their own pieces, by the ranks that read them)
    straight = [("f", begin, end - begin, zlib.crc32(data[begin:end])) for begin, end in direct]
    for world, loads in ((1, [3100]), (2, [3000, 100]), (3, [0, 3000, 100])):
        pieces = [checksum_share(str(tmp_path), manifest, ["f"], rank, world, skip={"f": Intervals(direct)},
                                 loads=loads) for rank in range(world)]
        checked = sorted(piece[2] for share in pieces for piece in share["pieces"])
        assert sum(checked) == len(data) - 3100, (world, checked)
        pieces[0]["pieces"] += straight
        assert check_pieces(str(tmp_path), pieces, complete=True) is None, world

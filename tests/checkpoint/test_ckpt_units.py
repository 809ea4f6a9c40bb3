"""Pieces of the checkpoint package on their own: file format, range reads, planning, codecs, rotation."""
from __future__ import annotations

import json
import os
import zlib

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from zerotrain.checkpoint import commit
from zerotrain.checkpoint.format import CheckpointError, SafetensorsWriter
from zerotrain.checkpoint.integrity import check_pieces, checksum_share, crc32_combine, write_manifest
from zerotrain.checkpoint.optim_state import probe_template
from zerotrain.checkpoint.plan import build_plan
from zerotrain.checkpoint.reader import TensorReader
from zerotrain.checkpoint.state import decode, encode


@pytest.mark.parametrize("direct", ["1", "0"])  # O_DIRECT through aligned buffers, and the buffered fallback
def test_streaming_writer_is_read_by_safetensors(tmp_path, monkeypatch, direct):
    monkeypatch.setenv("ZEROTRAIN_CHECKPOINT_ODIRECT", direct)
    tensors = {"a": torch.randn(3, 5).bfloat16(), "b": torch.tensor([True, False, True]), "s": torch.tensor(4.0),
               "e": torch.zeros(0, 4), "i": torch.arange(7, dtype=torch.int64),
               "big": torch.randn(3_000_001)}  # spans several aligned buffers, ends mid-block
    path = str(tmp_path / "x.safetensors")
    writer = SafetensorsWriter(path, [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()])
    for key, value in tensors.items():
        flat = value.reshape(-1)
        half = flat.numel() // 2
        writer.write(key, [flat[:half].contiguous(), flat[half:].contiguous()])  # pieces, in order
    size, crc = writer.close()
    data = open(path, "rb").read()
    assert size == len(data) and crc == zlib.crc32(data)
    loaded = load_file(path)
    for key, value in tensors.items():
        assert torch.equal(loaded[key], value), key
    with pytest.raises(CheckpointError, match="out of order"):
        SafetensorsWriter(str(tmp_path / "y.safetensors"), [("a", torch.float32, (2,))]).write("b", [])


@pytest.mark.parametrize("direct", ["1", "0"])
def test_a_failed_write_of_the_writer_thread_is_raised_naming_the_file(tmp_path, monkeypatch, direct):
    # O_DIRECT writes go out on the file's writer thread while the caller fills the next buffer (#50): the
    # thread's error must still reach the caller, with the file's path (a file size limit: EFBIG, a real error)
    import errno
    import resource
    monkeypatch.setenv("ZEROTRAIN_CHECKPOINT_ODIRECT", direct)
    path = str(tmp_path / "x.safetensors")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20 << 20, hard))
    try:
        writer = SafetensorsWriter(path, [("big", torch.float32, (12 << 20,))])  # 48 MB: past the limit
        with pytest.raises(OSError) as raised:  # by the write itself: 6 buffers, the 3rd fails, waited for at the 5th
            writer.write("big", [torch.ones(12 << 20)])
        writer.abort()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert raised.value.errno == errno.EFBIG and raised.value.filename == path
    assert os.path.getsize(path) <= 20 << 20


@pytest.mark.parametrize("direct", ["1", "0"])
def test_writers_and_readers_leave_no_descriptor_open(tmp_path, monkeypatch, direct):
    # a save writes hundreds of files and a load opens every one: a descriptor left open by a closed or aborted
    # writer, the streaming reader (`file_crc32`) or a TensorReader adds up over a long run (and keeps space of
    # deleted checkpoints allocated)
    from zerotrain.checkpoint.integrity import file_crc32
    monkeypatch.setenv("ZEROTRAIN_CHECKPOINT_ODIRECT", direct)

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    value = torch.arange(3 << 20, dtype=torch.float32)  # spans buffers
    before = open_fds()
    for name in ("closed", "aborted"):
        writer = SafetensorsWriter(str(tmp_path / f"{name}.safetensors"), [("v", value.dtype, tuple(value.shape))])
        writer.write("v", [value])
        writer.close() if name == "closed" else writer.abort()
    path = str(tmp_path / "closed.safetensors")
    assert file_crc32(path) == zlib.crc32(open(path, "rb").read())
    with TensorReader(str(tmp_path), {"v": "closed.safetensors"}, "model weights") as reader:
        assert torch.equal(reader.read_range("v", 5, 7), value[5:12])
    assert open_fds() == before


def test_range_reads_match_flat_slices(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {"m": torch.randn(5, 7, 3, generator=generator), "v": torch.randn(11, generator=generator),
               "r": torch.randn(1, 40, generator=generator)}
    save_file(tensors, str(tmp_path / "t.safetensors"))
    with TensorReader(str(tmp_path), {k: "t.safetensors" for k in tensors}, "test") as reader:
        for name, tensor in tensors.items():
            flat = tensor.reshape(-1)
            for start in range(0, flat.numel(), 3):
                for count in (0, 1, 2, 7, 22, flat.numel() - start):
                    count = min(count, flat.numel() - start)
                    assert torch.equal(reader.read_range(name, start, count), flat[start:start + count])
        with pytest.raises(CheckpointError, match="missing"):
            reader.read_range("nope", 0, 1)


def _layouts(world: int, shapes: dict, split_each: bool):
    """Layouts as ranks would describe them: every tensor split over all ranks, or a flat buffer split evenly."""
    layouts = [{"slots": [], "extras": [], "order": list(shapes) if r == 0 else []} for r in range(world)]
    states = {"exp_avg": "float32", "exp_avg_sq": "float32"}
    if split_each:  # stage-3 style: each parameter its own slot, cut in N
        for name, shape in shapes.items():
            numel = int(np.prod(shape))
            chunk = -(-numel // world)
            for r in range(world):
                lo, hi = r * chunk, min(numel, (r + 1) * chunk)
                records = [(name, shape, lo, hi - lo, 0)] if lo < hi else []
                layouts[r]["slots"].append({"trainable": True, "replicated": False, "numel": chunk,
                                            "model_dtype": "float32", "records": records, "states": states, "scalars": {"step": "float32"}})
    else:  # stage-1/2 style: one flat buffer of every parameter, cut in N
        offsets, total = {}, 0
        for name, shape in shapes.items():
            offsets[name], total = total, total + int(np.prod(shape))
        chunk = -(-total // world)
        for r in range(world):
            lo, hi, records = r * chunk, (r + 1) * chunk, []
            for name, shape in shapes.items():
                a, b = max(lo, offsets[name]), min(hi, offsets[name] + int(np.prod(shape)))
                if a < b:
                    records.append((name, shape, a - offsets[name], b - a, a - lo))
            layouts[r]["slots"].append({"trainable": True, "replicated": False, "numel": chunk,
                                        "model_dtype": "float32", "records": records, "states": states, "scalars": {"step": "float32"}})
    return layouts


@pytest.mark.parametrize("split_each", [False, True])
def test_plan_balances_bytes_and_covers_every_tensor(split_each):
    shapes = {f"layer{i}.weight": (64, 48 + 8 * (i % 3)) for i in range(12)}
    shapes.update({f"layer{i}.bias": (48,) for i in range(12)})
    world = 4
    plan = build_plan(_layouts(world, shapes, split_each), max_file_bytes=20_000)
    loads = [0] * world
    for tensor in plan.tensors.values():
        loads[tensor.writer] += tensor.nbytes(plan.master_separate)
        assert sum(p.numel for p in tensor.pieces) == tensor.numel
    assert max(loads) <= 1.25 * sum(loads) / world, loads
    model_map = plan.weight_map("model")
    assert set(model_map) == set(shapes)
    files = {spec.name for spec in plan.files if spec.kind == "model"}
    assert len(files) > world and all(name.endswith(f"-of-{len(files):05d}.safetensors") for name in files)
    moved = sum(sum(row[r] for r in range(world) if r != s) for rnd in plan.splits for s, row in enumerate(rnd))
    if not split_each:  # a flat buffer split evenly: writers mostly write what they hold
        assert moved < 0.2 * sum(loads)


def test_plan_rejects_holes():
    layouts = _layouts(2, {"w": (10,)}, split_each=True)
    layouts[1]["slots"][0]["records"] = []
    with pytest.raises(CheckpointError, match="cover"):
        build_plan(layouts)


def test_json_codec_roundtrip_and_rejects_objects():
    value = {"a": (1, 2.5, None), "t": torch.arange(4, dtype=torch.int16), "n": np.arange(3.0), 3: b"\x00\x01",
             "nested": [{"x": (True,)}]}
    back = decode(json.loads(json.dumps(encode(value))))
    assert back["a"] == (1, 2.5, None) and back[3] == b"\x00\x01" and back["nested"] == [{"x": (True,)}]
    assert torch.equal(back["t"], value["t"]) and np.array_equal(back["n"], value["n"])
    with pytest.raises(CheckpointError, match=r"client_state\['bad'\]"):
        encode({"bad": object()}, "client_state")


def test_range_reads_across_buffer_boundaries(tmp_path):
    big = torch.randn(5_000_003)
    save_file({"pad": torch.zeros(3, dtype=torch.int8), "big": big}, str(tmp_path / "t.safetensors"))
    with TensorReader(str(tmp_path), {"big": "t.safetensors"}, "test") as reader:
        for start, count in [(0, 5_000_003), (1, 2_097_152), (2_097_151, 2), (4_999_000, 1003)]:
            assert torch.equal(reader.read_range("big", start, count), big[start:start + count])
        target = torch.zeros(10, dtype=torch.float64)  # the dtype is converted on the way in
        reader.read_into("big", 17, 10, target)
        assert torch.equal(target, big[17:27].double())
        target = torch.zeros(4_000_000, dtype=torch.float64)  # converted through several bounce-buffer loads
        reader.read_into("big", 3, target.numel(), target)
        assert torch.equal(target, big[3:4_000_003].double())


def test_checksum_shares_join_into_file_crcs_and_name_a_corrupt_file(tmp_path):
    """Each rank checksums an equal byte range of the files laid end to end; joined, the pieces give every
    file's crc32 (a file cut between ranks included), and a flipped byte is named by its file."""
    rng = np.random.default_rng(0)
    sizes = {"a.safetensors": 9_000_001, "b.json": 0, "c.safetensors": 1_234_567, "d.json": 17}
    for name, size in sizes.items():
        (tmp_path / name).write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    manifest = {"files": {name: {"size": size, "crc32": f"{zlib.crc32((tmp_path / name).read_bytes()):08x}"}
                          for name, size in sizes.items()}}
    a, b = os.urandom(1000), os.urandom(3 << 20)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    from zerotrain.checkpoint.integrity import _crc32_combine  # the fallback without isal: the same values
    for length in (0, 1, 4, 4095, len(b)):
        assert _crc32_combine(zlib.crc32(a), zlib.crc32(b[:length]), length) == zlib.crc32(a + b[:length]), length
    for world, threads in ((1, 1), (2, 3), (3, 1)):
        shares = [checksum_share(str(tmp_path), manifest, sizes, rank, world, threads) for rank in range(world)]
        assert check_pieces(str(tmp_path), shares) is None
    data = bytearray((tmp_path / "c.safetensors").read_bytes())
    data[600_000] ^= 0x04
    (tmp_path / "c.safetensors").write_bytes(bytes(data))
    shares = [checksum_share(str(tmp_path), manifest, sizes, rank, 3) for rank in range(3)]
    error = check_pieces(str(tmp_path), shares)
    assert error is not None and "c.safetensors: checksum mismatch" in error and "a.safetensors" not in error
    assert error.startswith(str(tmp_path / "c.safetensors"))  # one corrupt file: its own one-line error
    # a rank that failed before its share was checked leaves its files unjudged (its own error is reported)
    assert check_pieces(str(tmp_path), shares[:1]) is None
    data = bytearray((tmp_path / "d.json").read_bytes())
    data[3] ^= 0x01
    (tmp_path / "d.json").write_bytes(bytes(data))
    shares = [checksum_share(str(tmp_path), manifest, sizes, rank, 2) for rank in range(2)]
    error = check_pieces(str(tmp_path), shares)  # two: both named
    assert error.startswith("2 files are corrupt") and "c.safetensors: checksum" in error and "d.json: checksum" in error


@pytest.mark.parametrize("make, keys", [
    (lambda p: torch.optim.AdamW([p], amsgrad=True), {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    (lambda p: torch.optim.SGD([p], lr=0.1, momentum=0.9), {"momentum_buffer"}),
    (lambda p: torch.optim.SGD([p], lr=0.1), set()),
])
def test_probe_finds_the_state_an_optimizer_keeps(make, keys):
    master = torch.zeros(5, requires_grad=True)
    template = probe_template(make(master), 0, master)
    assert set(template.elementwise) == keys


def test_rotation_counts_only_committed_checkpoints(tmp_path):
    save_dir = str(tmp_path)
    for tag in ("a", "b", "c"):
        os.makedirs(os.path.join(save_dir, tag))
        write_manifest(os.path.join(save_dir, tag), {}, {"tag": tag})
    os.makedirs(os.path.join(save_dir, "d" + ".zerotrain-tmp-0000"))  # a save in progress
    os.makedirs(os.path.join(save_dir, "user_notes"))                  # not ours
    commit.atomic_write_text(os.path.join(save_dir, "latest"), "a")  # latest is protected
    deleted = commit.rotate(save_dir, 1, just_committed="c")
    assert deleted == ["b"]
    assert sorted(os.listdir(save_dir)) == ["a", "c", "d.zerotrain-tmp-0000", "latest", "user_notes"]


def test_crc32_text_is_eight_hex_digits_and_parses_back():
    """The manifest's crc32 spelling: zero-padded to 8 hex digits (a crc below 0x10000000 too), read back as hex
    (all-digit spellings included), anything else refused naming the entry."""
    from zerotrain.checkpoint.integrity import crc32_text, parse_crc32

    for crc in (0, 0x1234, 0x0ABCDEF1, 0x12345678, 0xFFFFFFFF):
        text = crc32_text(crc)
        assert len(text) == 8 and text == text.lower() and parse_crc32(text) == crc
    assert crc32_text(0x1234) == "00001234"
    for bad in ("1234", "0x001234", "zzzzzzzz"):
        with pytest.raises(Exception, match="manifest"):
            parse_crc32(bad)


def test_plan_writes_a_pipeline_stage_s_buffers_from_that_stage():
    # PP2 x DP2: each stage's first rank lists the tensors outside its slots (buffers), which only that stage's
    # ranks hold; without extras_ranks the least-loaded writers would be ranks 0 and 1 for some of stage 1's
    layouts = _layouts(4, {"0.w": (64,)}, split_each=True)
    for layout in layouts:
        layout["extras_ranks"] = None
    layouts[2]["extras"] = [(f"3.buf{i}", (256,), "float32", False) for i in range(4)]
    layouts[2]["extras_ranks"], layouts[2]["order"] = [2, 3], [f"3.buf{i}" for i in range(4)]
    plan = build_plan(layouts)
    writers = {name: tensor.writer for name, tensor in plan.tensors.items()}
    assert list(plan.tensors) == ["0.w", "3.buf0", "3.buf1", "3.buf2", "3.buf3"], list(plan.tensors)
    assert {writers[f"3.buf{i}"] for i in range(4)} == {2, 3}, writers


def test_a_manifest_not_ours_is_refused_and_file_crc32_is_zlibs(tmp_path):
    """read_manifest takes only zerotrain's own manifest: another format name, `files` that is not a mapping,
    a newer format version or another checksum are each refused naming the file; a whole file's streamed
    crc32 (merge sources) is zlib's of its bytes."""
    from zerotrain.checkpoint.integrity import MANIFEST, file_crc32, read_manifest

    data = os.urandom((1 << 20) + 13)
    (tmp_path / "a.bin").write_bytes(data)
    assert file_crc32(str(tmp_path / "a.bin")) == zlib.crc32(data)
    write_manifest(str(tmp_path), {"a.bin": {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}}, {})
    good = json.loads((tmp_path / MANIFEST).read_text())
    assert read_manifest(str(tmp_path))["files"] == good["files"]
    for change in ({"format": "other"}, {"files": ["a.bin"]}, {"format_version": good["format_version"] + 1},
                   {"checksum": "md5"}):
        (tmp_path / MANIFEST).write_text(json.dumps({**good, **change}))
        with pytest.raises(CheckpointError, match=MANIFEST):
            read_manifest(str(tmp_path))


def test_plan_records_param_groups_and_stores_frozen_peft_base_weights_under_base_names():
    """trainer_state's param groups: each group's trainable tensors in state_dict order, no extra group; a frozen
    base weight of a PEFT-wrapped model is stored under the base model's name, a trainable one (and an adapter
    weight) under its own."""
    base = "base_model.model.layer.base_layer.weight"
    shapes = {"w0": (4, 3), "b0": (4,), "w1": (4, 3), base: (2, 2), "base_model.model.layer.lora_A.weight": (1, 2)}
    layouts = _layouts(2, shapes, split_each=True)
    for rank in range(2):
        for slot, name in zip(layouts[rank]["slots"], shapes):
            slot["group"] = {"w0": 0, "w1": 0, "b0": 1}.get(name, -1)
    plan = build_plan(layouts)
    assert plan.param_groups() == [["w0", "w1"], ["b0"]]
    assert plan.tensors[base].model_key == base  # trainable: its own name (its masters are keyed by it)
    for rank in range(2):
        layouts[rank]["slots"][3]["trainable"] = False
    layouts = [{**layout, "slots": [dict(s, trainable=False) if i == 4 else s for i, s in enumerate(layout["slots"])]}
               for layout in layouts]
    plan = build_plan(layouts)
    assert plan.tensors[base].model_key == "layer.weight"
    assert plan.tensors["base_model.model.layer.lora_A.weight"].model_key == "base_model.model.layer.lora_A.weight"


def test_plan_shards_fills_files_up_to_the_shard_size_in_order():
    """Entries in order, each file at most `shard_size` bytes (counted as numel x itemsize), a larger tensor in a
    file of its own, the first file never empty."""
    from zerotrain.checkpoint.format import plan_shards

    entries = [("a", torch.float32, (10,)), ("b", torch.float32, (10,)), ("c", torch.bfloat16, (20,)),
               ("big", torch.float32, (100,)), ("d", torch.float32, (2, 5))]
    files = plan_shards(entries, shard_size=80)
    assert [[e[0] for e in f] for f in files] == [["a", "b"], ["c"], ["big"], ["d"]]
    assert [[e[0] for e in f] for f in plan_shards(entries[3:], shard_size=80)] == [["big"], ["d"]]


def test_read_header_gives_each_tensors_dtype_and_shape(tmp_path):
    from zerotrain.checkpoint.format import read_header

    save_file({"w": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}, str(tmp_path / "t.safetensors"))
    header = read_header(str(tmp_path / "t.safetensors"))
    assert {name: (entry["dtype"], entry["shape"]) for name, entry in header.items()} == \
        {"w": ("F32", [2, 3]), "b": ("BF16", [4])}
    # a header of 60 MiB (safetensors allows up to 100 MB; zerotrain's cap is 100 MiB) is read; 101 MiB is refused
    for mib, ok in ((60, True), (101, False)):
        body = json.dumps({"__metadata__": {"pad": ""}}).encode()
        body = body.replace(b'""', b'"' + b"x" * ((mib << 20) - len(body)) + b'"')
        (tmp_path / "big.safetensors").write_bytes(len(body).to_bytes(8, "little") + body)
        if ok:
            assert read_header(str(tmp_path / "big.safetensors")) == {}
        else:
            with pytest.raises(CheckpointError, match="corrupt safetensors header"):
                read_header(str(tmp_path / "big.safetensors"))


@pytest.mark.parametrize("direct", ["1", "0"])  # whole blocks O_DIRECT + partial blocks buffered; all buffered
def test_placed_writers_fill_one_file_in_place_and_their_runs_join_into_its_crc32(tmp_path, monkeypatch, direct):
    # two writers (as two ranks of a save without the exchange, #50) write interleaved runs of one file at
    # offsets that share blocks, through 3-block buffers (runs cross buffers); every byte lands once in place,
    # and the runs' crc32s joined with crc32_combine are the file's crc32
    from zerotrain.checkpoint.directio import PlacedWriter
    from zerotrain.checkpoint.format import crc32
    from zerotrain.checkpoint.integrity import crc32_combine, join_runs
    monkeypatch.setenv("ZEROTRAIN_CHECKPOINT_ODIRECT", direct)
    data = np.random.default_rng(0).integers(0, 256, 100_003, dtype=np.uint8).tobytes()
    cuts = [0, 5, 4096, 4099, 9000, 20_480, 20_481, 50_000, 50_001, 61_440, 99_999, 100_003]
    path = str(tmp_path / "shared.safetensors")
    writers = [PlacedWriter(crc32, crc32_combine, buffer_bytes=3 * 4096, buffers=buffers) for buffers in (2, 5)]
    for writer in writers:
        writer.open(path, len(data))
    for index, (start, stop) in enumerate(zip(cuts, cuts[1:])):
        writer = writers[index % 2]
        writer.begin(path, start)
        middle = (start + stop) // 2  # two writes per run, the second continuing the first
        writer.write(data[start:middle])
        writer.write(memoryview(data)[middle:stop])
    writers[0].begin(path, 100_003)  # a run begun where the writer's last one ended joins it: no new run
    runs = [run for writer in writers for run in writer.close()]
    assert open(path, "rb").read() == data
    assert len(runs) == len(cuts) - 1 and sorted(run[2] for run in runs) == sorted(b - a for a, b in zip(cuts, cuts[1:]))
    named = [("shared.safetensors", offset, length, crc) for _, offset, length, crc in runs]
    assert join_runs(str(tmp_path), {"shared.safetensors": len(data)}, named) == {"shared.safetensors": zlib.crc32(data)}


def test_join_runs_names_the_file_a_save_did_not_cover_exactly(tmp_path):
    from zerotrain.checkpoint.integrity import join_runs
    data = bytes(range(256)) * 4
    runs = [("f", 0, 100, zlib.crc32(data[:100])), ("f", 100, 924, zlib.crc32(data[100:]))]
    assert join_runs("d", {"f": 1024}, runs) == {"f": zlib.crc32(data)}
    with pytest.raises(CheckpointError, match=r"d/f: bytes 100 to 200 of 1024 were written by no rank"):
        join_runs("d", {"f": 1024}, [runs[0], ("f", 200, 824, 0)])
    with pytest.raises(CheckpointError, match=r"d/f: bytes 300 to 310 of 1024 were written by no rank"):
        join_runs("d", {"f": 1024}, [runs[0], ("f", 100, 200, 0), ("f", 310, 714, 0)])  # after the 2nd run
    with pytest.raises(CheckpointError, match=r"d/f: bytes 90 to 100 of 1024 were written twice"):
        join_runs("d", {"f": 1024}, [runs[0], ("f", 90, 934, 0)])
    with pytest.raises(CheckpointError, match=r"d/f: bytes 100 to 1024 of 1024 were written by no rank"):
        join_runs("d", {"f": 1024}, runs[:1])
    with pytest.raises(CheckpointError, match=r"d/f: written to byte 1030, past its 1024 bytes"):
        join_runs("d", {"f": 1024}, [runs[0], ("f", 100, 930, 0)])
    with pytest.raises(CheckpointError, match=r"d/g: written, but not a file of the save plan"):
        join_runs("d", {"f": 1024}, runs + [("g", 0, 1, 0)])
    with pytest.raises(CheckpointError, match=r"d/f: bytes 0 to 1024 of 1024 were written by no rank"):
        join_runs("d", {"f": 1024}, [])


def test_a_zero_3_plan_moves_no_bytes():
    # ZeRO-3 (every tensor split over the ranks) used to send about half of every rank's bytes to the tensor's
    # writer (#50); now each rank writes its own pieces in place, so nothing is exchanged (tensor-parallel
    # split tensors still are: tests/checkpoint/test_ckpt_tensor_parallel.py)
    shapes = {f"layer{i}.weight": (64, 48) for i in range(6)}
    plan = build_plan(_layouts(2, shapes, split_each=True))
    assert all(t.in_place for t in plan.tensors.values())
    assert sum(sum(row) for rnd in plan.splits for row in rnd) == 0
    assert all(not list(plan.transfers(i, s, r)) for i in range(len(plan.rounds)) for s in range(2) for r in range(2))


def test_a_file_whose_checksum_pieces_do_not_start_at_its_first_byte_is_not_judged():
    # corrupt_files judges only a file its pieces cover exactly: a piece as long as the file but starting past
    # byte 0 (a rank's share gone wrong) leaves the verdict to that rank's own error
    share = {"files": {"f": [4, "00000000"]}, "pieces": [("f", 1, 4, 5)]}
    assert check_pieces("d", [share]) is None
    share["pieces"] = [("f", 0, 4, 5)]
    assert "d/f: checksum mismatch (crc32 00000005, manifest says 00000000)" in check_pieces("d", [share])


def test_a_page_cache_read_past_the_end_of_a_file_names_it(tmp_path):
    # a load's copy out of the page cache (SharedFiles.read_into) of a file shorter than the plan says: an error
    # naming the file and the byte where it ends, not a read that waits forever for bytes that never come
    from zerotrain.checkpoint.directio import SharedFiles
    path = str(tmp_path / "short.bin")
    with open(path, "wb") as handle:
        handle.write(bytes(range(100)))
    buffer = bytearray(10)
    with SharedFiles() as files:
        files.read_into(path, 90, buffer)
        assert bytes(buffer) == bytes(range(90, 100))
        with pytest.raises(OSError, match=r"short.bin: file ends at byte 100, needed bytes up to 105"):
            files.read_into(path, 95, buffer)


def test_intervals_merge_subtract_and_leave_gaps():
    from zerotrain.checkpoint.integrity import Intervals
    held = Intervals([(10, 20), (30, 40)])
    held.add(20, 25)  # touching: merged
    held.add(5, 7)
    assert held.ranges == [[5, 7], [10, 25], [30, 40]]
    assert held.minus(0, 50) == [(0, 5), (7, 10), (25, 30), (40, 50)]
    assert held.minus(12, 35) == [(25, 30)] and held.minus(11, 24) == [] and held.minus(40, 41) == [(40, 41)]
    held.add(6, 31)  # spans three ranges: one
    assert held.ranges == [[5, 40]] and held.gaps(45) == [(0, 5), (40, 45)] and held.gaps(40) == [(0, 5)]
    held.add(3, 3)  # empty: nothing
    assert held.ranges == [[5, 40]] and Intervals().gaps(7) == [(0, 7)]


def test_reads_straight_into_tensors_and_the_shares_of_the_rest_cover_each_file_once(tmp_path):
    """A resume before the first step: each rank reads its ranges straight into new tensors with the crc32 of the
    bytes it claims (overlapping reads counted once: the lower rank's, then this rank's first read), every other
    byte is shared out by checksum_share(skip=...); joined, the pieces give every file's crc32 and a flipped byte in
    a range read straight in is named by its file. A piece missing or counted twice is an error, not a pass."""
    from zerotrain.checkpoint.integrity import Intervals, claimed_ranges
    values = {"w": torch.arange(3000, dtype=torch.float32), "v": -torch.arange(700, dtype=torch.float32),
              "h": torch.arange(10, dtype=torch.float16)}
    save_file(values, str(tmp_path / "o.safetensors"))
    (tmp_path / "s.json").write_bytes(b"{}")
    sizes = {name: os.path.getsize(tmp_path / name) for name in ("o.safetensors", "s.json")}
    manifest = {"files": {name: {"size": size, "crc32": f"{zlib.crc32((tmp_path / name).read_bytes()):08x}"}
                          for name, size in sizes.items()}}
    reader = TensorReader(str(tmp_path), {name: "o.safetensors" for name in values}, "optimizer states")
    # rank 0 reads w[0:2000] and v[100:700] (twice: a tied copy); rank 1 w[1000:3000]; rank 2 nothing
    reads = [[("w", 0, 2000), ("v", 100, 600), ("v", 100, 600)], [("w", 1000, 2000)], []]
    ranges = [[reader.byte_range(name, start, count) for name, start, count in mine] for mine in reads]
    assert ranges[1][0][2] - ranges[1][0][1] == 2000 * 4 and ranges[0][1][0] == "o.safetensors"
    skip: dict = {}
    for mine in ranges:
        for name, begin, end in mine:
            skip.setdefault(name, Intervals()).add(begin, end)

    def shares(intact: bool = True) -> list:
        out = []
        for rank, mine in enumerate(reads):
            share = checksum_share(str(tmp_path), manifest, sizes, rank, len(reads), skip=skip)
            lower = [entry for theirs in ranges[:rank] for entry in theirs]
            for (name, start, count), claim in zip(mine, claimed_ranges(ranges[rank], lower)):
                target = torch.full((count,), 7.0)
                share["pieces"] += reader.read_checked(name, start, count, target, claim)
                assert torch.equal(target, values[name][start:start + count]) or not intact, (rank, name)
            out.append(share)
        return out

    good = shares()
    assert check_pieces(str(tmp_path), good, complete=True) is None
    assert claimed_ranges(ranges[0], [])[2] == []  # the tied copy's bytes: counted with its first read
    assert claimed_ranges(ranges[1], ranges[0])[0] == [(ranges[0][0][2], ranges[1][0][2])]  # past rank 0's w
    # a piece left out, or counted twice: refused naming the file and the bytes, when every rank succeeded
    missing = [dict(good[0], pieces=good[0]["pieces"][1:])] + good[1:]
    assert "were checked by no rank" in check_pieces(str(tmp_path), missing, complete=True)
    assert check_pieces(str(tmp_path), missing) is None  # a failed rank's own error explains it instead
    twice = [dict(good[0], pieces=good[0]["pieces"] + good[1]["pieces"][-1:])] + good[1:]
    assert "checked twice" in check_pieces(str(tmp_path), twice, complete=True)
    with pytest.raises(CheckpointError, match="do not fit"):  # only straight reads of the stored dtype
        reader.read_checked("h", 0, 10, torch.zeros(10), [])
    assert not reader.can_read_checked("h", torch.zeros(10)) and reader.can_read_checked("h", torch.zeros(10).half())
    data = bytearray((tmp_path / "o.safetensors").read_bytes())
    data[ranges[1][0][2] - 3] ^= 0x10  # inside w[1000:3000], claimed by rank 1 only
    (tmp_path / "o.safetensors").write_bytes(bytes(data))
    error = check_pieces(str(tmp_path), shares(intact=False), complete=True)
    assert error.startswith(str(tmp_path / "o.safetensors") + ": checksum mismatch"), error
    reader.close()


@pytest.mark.parametrize("direct", ["1", "0"])  # O_DIRECT through each thread's aligned buffer; buffered
def test_checked_reads_land_unaligned_ranges_exactly_and_their_pieces_join_into_the_claims_crc32(tmp_path,
                                                                                               monkeypatch, direct):
    # a start-up load's reads straight into new optimizer states (#50, run 27): ranges at any byte offset into
    # destinations at any address, cut into chunks that end inside blocks and read on several threads; every
    # byte lands in place, and the pieces of each claim join (crc32_combine) into the claim's own crc32
    from zerotrain.checkpoint.directio import CheckedReads
    from zerotrain.checkpoint.format import crc32
    from zerotrain.checkpoint.integrity import _join
    monkeypatch.setenv("ZEROTRAIN_CHECKPOINT_ODIRECT", direct)
    data = np.random.default_rng(1).integers(0, 256, 100_003, dtype=np.uint8).tobytes()
    path = str(tmp_path / "o.safetensors")
    open(path, "wb").write(data)
    reads = CheckedReads(crc32, threads=3, chunk=3 * 4096 + 5)
    spans = [(1, 40_000, [(1, 9_000), (20_000, 40_000)]), (40_000, 100_003, [(40_000, 100_003)]),
             (9_000, 9_003, [(9_000, 9_003)]), (77, 50_077, [])]  # the last: read, claimed by a lower rank
    outs = []
    for index, (begin, end, claims) in enumerate(spans):
        out = np.zeros(end - begin + 8, dtype=np.uint8)[index + 1:index + 1 + end - begin]  # odd addresses
        outs.append(out)
        reads.add("o.safetensors", path, begin, out, claims)
    pieces = reads.run()
    for (begin, end, _), out in zip(spans, outs):
        assert out.tobytes() == data[begin:end], (begin, end)
    assert len(pieces) > 6  # one per claimed part of a chunk
    claimed = [(first, last) for _, _, claims in spans for first, last in claims]
    joined = _join(pieces)
    assert [(piece[1], piece[1] + piece[2]) for piece in joined] == [(1, 9_003), (20_000, 100_003)]
    assert [piece[3] for piece in joined] == [zlib.crc32(data[1:9_003]), zlib.crc32(data[20_000:])]
    assert sum(last - first for first, last in claimed) == sum(piece[2] for piece in pieces)
    short = CheckedReads(crc32, threads=2, chunk=8192)
    short.add("o.safetensors", path, 99_000, np.zeros(2000, dtype=np.uint8), [])
    with pytest.raises(OSError, match=r"o\.safetensors: file ends at byte 100003"):
        short.run()
    with pytest.raises(ValueError, match="outside the read"):
        CheckedReads(crc32).add("o", path, 10, np.zeros(5, dtype=np.uint8), [(9, 12)])


def test_checksum_shares_are_balanced_against_the_bytes_each_rank_reads_straight_in(tmp_path):
    # rank 0 reads 600 bytes straight in, rank 1 none: of the 1000 bytes nobody reads that way rank 0 checks
    # 200 and rank 1 800 (each reads 800 in all), and the two shares still cover the file once; a rank that
    # already reads more than the level takes nothing
    from zerotrain.checkpoint.integrity import balanced_share
    assert [balanced_share(1000, rank, [600, 0]) for rank in (0, 1)] == [(0, 200), (200, 1000)]
    assert [balanced_share(10, rank, [50, 0, 3]) for rank in (0, 1, 2)] == [(0, 0), (0, 7), (7, 10)]
    assert [balanced_share(11, rank, [0, 0]) for rank in (0, 1)] == [(0, 6), (6, 11)]
    assert [balanced_share(7, rank, [0, 0, 0]) for rank in (0, 1, 2)] == [(0, 3), (3, 5), (5, 7)]
    data = bytes(range(256)) * 4 + b"abc"
    (tmp_path / "f").write_bytes(data)
    manifest = {"files": {"f": {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}}}
    shares = [checksum_share(str(tmp_path), manifest, ["f"], rank, 2, loads=[600, 0]) for rank in (0, 1)]
    # 1027 bytes: rank 0 checks 214 (814 in all), rank 1 813 (offset, length)
    assert [[piece[1:3] for piece in share["pieces"]] for share in shares] == [[(0, 214)], [(214, 813)]]
    assert check_pieces(str(tmp_path), shares, complete=True) is None

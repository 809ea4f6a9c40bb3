"""#50 (run 30): the fixed cost of a save's fsyncs, one after another (main before run 30) or in batches.

Each round stages a checkpoint-shaped directory beside its final place (FILES data files of DATA_KIB each and
SMALL small JSON-sized files, written through the page cache) and commits it with `latest` naming it, once per
variant, the order alternating per round; the time is from the first fsync to `latest` replaced (the writes
before are not timed). Both variants make the same promise: every file and the staged directory durable before
the directory's rename, the rename durable before `latest` is replaced, `latest`'s new file durable before it
replaces `latest`, and the replacement durable before the call returns.

  serial   main before run 30, rank 0 of a save: each data file fsynced (`PlacedWriter.close`), then each small
           file written and fsynced (`write_json`), the manifest written and fsynced, the staged directory
           fsynced, renamed, the parent fsynced, `latest` written to a temporary file, fsynced, renamed, the
           parent fsynced (`commit.atomic_write_text`)
  batched  zerotrain now: the data and small files fsynced in one batch (`directio.fsync_all`, each on its own
           thread: the file system commits fsyncs in flight together), the manifest, the staged directory and
           `latest`'s new file in a second batch, then rename, parent fsync, rename, parent fsync
           (`commit.StagedDirectory.commit(latest=True, also=...)`)

    PYTHONPATH=. python benchmarks/commit_fsyncs.py --rounds 9 [--dir D]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

from zerotrain.checkpoint import commit
from zerotrain.checkpoint.directio import fsync_all
from zerotrain.checkpoint.format import fsync_file


def _stage(parent: str, tag: str, files: int, data_kib: int, small: int) -> tuple[commit.StagedDirectory, list, list]:
    staged = commit.StagedDirectory(os.path.join(parent, tag))
    data, smalls = [], []
    for index in range(files):
        path = os.path.join(staged.path, f"data-{index}.safetensors")
        with open(path, "wb") as handle:
            handle.write(os.urandom(1024) * data_kib)
        data.append(path)
    for index in range(small):
        path = os.path.join(staged.path, f"small-{index}.json")
        with open(path, "wb") as handle:
            handle.write(b'{"x": %d}' % index)
        smalls.append(path)
    return staged, data, smalls


def serial(staged: commit.StagedDirectory, data: list, smalls: list) -> None:
    for path in data + smalls:
        fsync_file(path)
    manifest = os.path.join(staged.path, "manifest.json")
    with open(manifest, "wb") as handle:
        handle.write(b"{}")
        handle.flush()
        os.fsync(handle.fileno())
    commit.fsync_dir(staged.path)
    os.rename(staged.path, staged.final)
    commit.fsync_dir(staged.parent)
    commit.atomic_write_text(os.path.join(staged.parent, "latest"), os.path.basename(staged.final))


def batched(staged: commit.StagedDirectory, data: list, smalls: list) -> None:
    fsync_all(data + smalls)
    manifest = os.path.join(staged.path, "manifest.json")
    with open(manifest, "wb") as handle:
        handle.write(b"{}")
    staged.commit(latest=True, also=[manifest])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--files", type=int, default=3, help="data files (a 70m save's rank 0 writes into 2-3)")
    parser.add_argument("--data-kib", type=int, default=64, help="dirty bytes per data file (O_DIRECT leaves "
                        "only the partial blocks and the length dirty)")
    parser.add_argument("--small", type=int, default=5, help="small files (rank 0: RNG, indexes, trainer state)")
    parser.add_argument("--dir", default=None, help="where (default: a new directory under the current one)")
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="commit_fsyncs_", dir=os.getcwd())
    os.makedirs(root, exist_ok=True)
    variants = {"serial": serial, "batched": batched}
    times: dict[str, list] = {name: [] for name in variants}
    try:
        for index in range(args.rounds):
            order = list(variants) if index % 2 == 0 else list(variants)[::-1]
            for name in order:
                parent = os.path.join(root, name)
                os.makedirs(parent, exist_ok=True)
                staged, data, smalls = _stage(parent, f"t{index}", args.files, args.data_kib, args.small)
                start = time.perf_counter()
                variants[name](staged, data, smalls)
                times[name].append(time.perf_counter() - start)
            print(f"round {index + 1}: " + ", ".join(f"{n} {times[n][-1] * 1e3:.1f} ms" for n in order), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = statistics.median(times["serial"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:8s} median {median * 1e3:6.1f} ms (spread {min(values) * 1e3:.1f}-{max(values) * 1e3:.1f}), "
              f"{median / base:.2f}x serial")
    print(f"load average {' '.join('%.2f' % x for x in os.getloadavg())}")


if __name__ == "__main__":
    main()

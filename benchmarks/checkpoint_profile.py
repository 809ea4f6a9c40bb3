"""Where one durable save and one cold load spend their time, per rank (``checkpoint_speed.py --profile``).

Each rank of a fresh pair of processes trains ``--warmup`` steps, then runs one synchronous save
(DeepSpeed's followed by an fsync of its files: the durable save it is compared with) and, after rank 0
dropped the files from the page cache, one load, each under ``cProfile``. Every function's *own* time
(cProfile's tottime, so the phases add up to the whole) is put in a phase by what it is (``PHASES``): the
syscalls are the I/O (``posix.write`` the writes, ``posix.fsync`` split by caller into the files' fsyncs
and the commit's directory fsyncs, ``preadv`` reads and copies out of the page cache), ``crc32`` the
checksum (on a cold load it also pays the page faults that read the disk: the mapping is read by the
checksum itself), the collectives the exchange, ``cat``/``copy_``/memory-view assignment the copies, the
pickler the serialization. What falls in no phase is "python" (the interpreter's own work). Shares are
what to read on a loaded machine; absolute seconds vary with the load.
"""
from __future__ import annotations

import cProfile
import json
import os
import pstats
import time
from pathlib import Path

# (phase, predicate on (file, function name, caller function names)); the first that matches wins
PHASES = [
    ("directory fsync", lambda f, n, c: "fsync" in n and any(x in ("fsync_dir",) for x in c)),
    ("small-file fsync", lambda f, n, c: "fsync" in n and any(x in ("write_json", "atomic_write_text",
                                                                    "write_manifest") for x in c)),
    ("data fsync", lambda f, n, c: "fsync" in n),
    ("crc32 (cold: + page faults = disk read)", lambda f, n, c: "crc32" in n),
    ("write syscalls", lambda f, n, c: n in ("<built-in method posix.write>", "<built-in method posix.pwrite>",
                                             "<built-in method posix.writev>", "<built-in method posix.pwritev>")
     or n.endswith("'write' of '_io.BufferedWriter' objects>") or "write_record" in n or "write_file" in n),
    ("read syscalls / copy out of the page cache", lambda f, n, c: "preadv" in n or "pread" in n or
     n.endswith("'read' of '_io.BufferedReader' objects>") or "readinto" in n or "get_record" in n
     or "read_record" in n or "'read' of" in n),
    ("mmap / munmap", lambda f, n, c: "mmap" in n),
    ("renames", lambda f, n, c: "rename" in n or "replace" in n and "posix" in n),
    ("collectives (exchange, agreement)", lambda f, n, c: "_distributed_c10d" in n or "/zerotrain/comm/" in f or f.endswith(("distributed_c10d.py",
                                                                      "c10d_logger.py")) or "all_to_all" in n or "all_gather" in n or
     "broadcast" in n or "barrier" in n or "'wait' of" in n or "recv" in n or "send" in n
     or "_object_to_tensor" in n or "_tensor_to_object" in n or "all_reduce" in n),
    ("copies (pack, staging, into buffers)", lambda f, n, c: "'cat'" in n or "'copy_'" in n or "'clone'" in n
     or "'contiguous'" in n or (n == "write" and f.endswith("directio.py")) or "'to'" in n
     or "'_to_copy'" in n or "'cpu'" in n),
    ("serialization (pickle, json, headers)", lambda f, n, c: "pickle" in n.lower() or "dump" in n
     or "json" in f or "'loads'" in n or "'load'" in n or "_rebuild" in n or "persistent_load" in n
     or "persistent_id" in n or "reduce_ex" in n),
    ("file open / close / stat / mkdir", lambda f, n, c: any(x in n for x in ("posix.open", "posix.close",
                                                                             "posix.stat", "posix.mkdir",
                                                                             "posix.listdir", "'close'",
                                                                             "posix.ftruncate", "io.open",
                                                                             "posix.scandir", "fadvise",
                                                                             "posix.remove", "posix.unlink",
                                                                             "makedirs"))),
    ("thread waits / locks", lambda f, n, c: "acquire" in n or "'result'" in n),
]


def _name(key) -> str:
    filename, line, func = key
    return func if filename == "~" else func


# calls counted on the profiled (main) thread: what each is, and the predicate on (file, function name)
COUNTS = [
    ("fsync", lambda f, n: "posix.fsync" in n),
    ("rename", lambda f, n: n in ("<built-in method posix.rename>", "<built-in method posix.replace>")),
    ("collective", lambda f, n: n in ("all_gather_object", "all_to_all_bytes", "barrier", "broadcast_object",
                                      "all_reduce", "all_gather") and ("/zerotrain/comm/" in f or "c10d" in f)),
    ("thread start", lambda f, n: n == "start" and f.endswith("threading.py")),
    ("open", lambda f, n: n == "<built-in method posix.open>"),
    ("torch.empty/zeros", lambda f, n: n in ("<built-in method empty of type object at", "<built-in method zeros>")
     or n.startswith("<built-in method empty of") or n.startswith("<built-in method zeros of")),
]


def _proc_counters() -> dict:
    """This process's I/O syscalls and bytes (all threads: /proc/self/io) and its context switches."""
    import resource
    out = {}
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            key, value = line.split(":")
            out[key.strip()] = int(value)
    except OSError:
        pass
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["voluntary_switches"], out["involuntary_switches"] = usage.ru_nvcsw, usage.ru_nivcsw
    out["minor_faults"] = usage.ru_minflt
    return out


def _delta(before: dict, after: dict) -> dict:
    return {key: after[key] - before.get(key, 0) for key in after}


def breakdown(profile: cProfile.Profile) -> dict:
    """{phase: own seconds} of a profile, "top": the 12 largest functions by own time, "counts": calls of
    COUNTS' kinds on the profiled thread."""
    stats = pstats.Stats(profile)
    phases: dict[str, float] = {}
    counts: dict[str, int] = {}
    top = []
    for key, (_, ncalls, own, _, callers) in stats.stats.items():
        filename, _, func = key
        caller_names = [c[2] for c in callers]
        label = func if filename == "~" else f"{os.path.basename(filename)}:{func}"
        phase = next((p for p, test in PHASES if test(filename, func, caller_names)), "python (interpreter)")
        phases[phase] = phases.get(phase, 0.0) + own
        top.append((own, label))
        for what, test in COUNTS:
            if test(filename, func):
                counts[what] = counts.get(what, 0) + ncalls
    top.sort(reverse=True)
    return {"phases": phases, "counts": counts, "top": [(label, round(own, 4)) for own, label in top[:12]]}


def _dump(profile: cProfile.Profile, root: Path, op: str, rank: int) -> None:
    """The raw profile as `<root>/<op>.rank<rank>.pstats` (for `pstats`' callers and callees)."""
    profile.dump_stats(str(root / f"{op}.rank{rank}.pstats"))


def profile_run(job, root: Path, engine: str, rank: int, fsync_tree, drop_cache, barrier, fresh=None) -> dict:
    """One save (made durable) and one cold load of `job` under cProfile; phase seconds per rank, with the
    process's I/O syscalls, bytes and context switches (all threads) and the calls of COUNTS. With `fresh` (a
    callable returning a new job of the same engine: a resume at start-up, no optimizer state yet), the load
    is that new job's, `job` dropped first."""
    out = {}
    tag = "prof"
    barrier()
    profile = cProfile.Profile()
    t0, c0, k0 = time.perf_counter(), time.process_time(), _proc_counters()
    profile.enable()
    job.save(tag)
    if not job.durable:
        fsync_tree(root / tag)  # DeepSpeed: the fsync that makes its save durable
    profile.disable()
    out["save"] = {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                   "process": _delta(k0, _proc_counters()), **breakdown(profile)}
    _dump(profile, root, "save", rank)
    if fresh is not None:
        del job
        import gc
        gc.collect()
        job = fresh()
    barrier()
    if rank == 0:
        drop_cache(root / tag)
    barrier()
    profile = cProfile.Profile()
    t0, c0, k0 = time.perf_counter(), time.process_time(), _proc_counters()
    profile.enable()
    job.load(tag)
    profile.disable()
    out["load"] = {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                   "process": _delta(k0, _proc_counters()), **breakdown(profile)}
    _dump(profile, root, "load", rank)
    return out


def print_profiles(profiles: dict) -> None:
    """Per engine and rank: the wall and CPU seconds of the save and the load, each phase's share of the wall."""
    for op in ("save", "load"):
        print(f"\n{op}: per-rank phases, share of the profiled wall time (own time, cProfile)\n")
        for engine, ranks in profiles.items():
            for rank, result in enumerate(ranks):
                r = result[op]
                total = r["wall_s"]
                parts = sorted(r["phases"].items(), key=lambda kv: -kv[1])
                text = "; ".join(f"{phase} {seconds:.3f}s ({100 * seconds / total:.0f}%)" for phase, seconds in parts
                                 if seconds >= 0.005)
                print(f"- {engine} rank {rank}: wall {total:.2f}s, CPU {r['cpu_s']:.2f}s: {text}")
                print(f"    top: {', '.join(f'{name} {own:.3f}' for name, own in r['top'][:8])}")
                proc = r.get("process", {})
                print(f"    calls (profiled thread): {r.get('counts', {})}; process (all threads): "
                      f"{proc.get('syscr', 0)} read / {proc.get('syscw', 0)} write syscalls, "
                      f"{proc.get('read_bytes', 0) / 1e6:.0f} MB from / {proc.get('write_bytes', 0) / 1e6:.0f} MB to "
                      f"the disk, {proc.get('voluntary_switches', 0)} voluntary / "
                      f"{proc.get('involuntary_switches', 0)} involuntary switches, "
                      f"{proc.get('minor_faults', 0)} minor faults")


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=1))

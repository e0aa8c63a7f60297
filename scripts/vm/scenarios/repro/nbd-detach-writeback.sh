# Open bug, not run by CI: `tiercache detach` in writeback while fio with verify writes to ext4
# on /dev/nbd0 (detach_in_use in writeback) did not return within the guest's 15-minute hang
# guard in 3 of 5 boots on 2026-11-27 (18-43 MiB dirty at the detach; the guest idle meanwhile:
# a wait, not a busy loop), with --data-path uring and with threads alike; the same in
# writethrough, and ublk-detach in writeback, passed every time. Run it with
# scripts/vm/run.sh repro/nbd-detach-writeback; once it passes reliably, move it back into CI.
detach_in_use nbd writeback

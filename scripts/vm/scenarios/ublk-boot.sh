# At boot, as systemd runs it: tiercache.service's own ExecStart (contrib/systemd, Type=notify)
# with `ublk = true` in its configuration, and README's srv.mount ordered after it, which is
# mounted the moment the server tells systemd READY=1 (over $NOTIFY_SOCKET, received here by
# socat): /dev/ublkb0 must be there by then. Shut down in systemd's order (the mount first,
# then SIGTERM to the server, which must remove the device and exit 0), booted again: the
# mount at READY=1 finds the files, the checker is clean.
tc_make
unit_config
unit_start
mkfs.ext4 -q -F /dev/ublkb0
mount /dev/ublkb0 "$MNT"
make_files "$MNT/before" 20 b
umount "$MNT"
say "systemctl stop: SIGTERM after the unmount"
tc_stop
[ ! -e /dev/ublkb0 ] || die "/dev/ublkb0 is still there after the server stopped"
say "boot again"
unit_start
mount /dev/ublkb0 "$MNT"
verify_files
umount "$MNT"
fs_check ext4 /dev/ublkb0
tc_stop
# As root with every capability, the server marked itself an I/O flusher (PR_SET_IO_FLUSHER):
# a filesystem on /dev/ublkbN cannot deadlock it under memory pressure.
! grep -q "not marked an I/O flusher" /tmp/serve.log || die "serve --ublk is not an I/O flusher: $(grep 'I/O flusher' /tmp/serve.log)"

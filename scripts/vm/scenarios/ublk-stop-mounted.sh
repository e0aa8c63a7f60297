# A stop that cannot finish in time: SIGTERM while ext4 is still mounted on /dev/ublkb0. The
# driver deletes the device only once the filesystem lets it go, so the server gives up on the
# delete at its deadline (--shutdown-timeout 3), says so, saves the cache and exits 0 instead
# of waiting for the unmount. The filesystem has lost its device; unmounted, the number is free
# again: the next serve --ublk is /dev/ublkb0, every file fsync'd before the stop is intact and
# the checker is clean. Before the unmount, a serve --ublk that wants the number is refused
# within ublk::DEAD_DELETE_WAIT, saying the device is held, instead of waiting for ever.
tc_make
tc_serve --ublk --shutdown-timeout 3
ublk_wait 0
mkfs.ext4 -q -F /dev/ublkb0
mount /dev/ublkb0 "$MNT"
make_files "$MNT/before" 20 s
say "SIGTERM with the filesystem mounted"
tc_stop
grep -q 'left to the driver' /tmp/serve.log || { tail -20 /tmp/serve.log; die "serve did not say it gave up on /dev/ublkb0"; }
grep -q 'closed cleanly' /tmp/serve.log || { tail -20 /tmp/serve.log; die "serve did not save the cache"; }
say "restart with the filesystem still mounted on the dead device: refused, within its bound"
rc=0
timeout 120 tiercache serve --cache "$CACHE" --backing "$BACKING" --socket "$SOCK" --ublk \
    > /tmp/held.log 2>&1 || rc=$?
[ $rc != 0 ] && [ $rc != 124 ] || { cat /tmp/held.log; die "serve over a held dead /dev/ublkb0 exited $rc (124: it waited unbounded)"; }
grep -q 'still held open' /tmp/held.log || { cat /tmp/held.log; die "serve did not say /dev/ublkb0 is held"; }
umount "$MNT" 2> /dev/null || umount -l "$MNT"
say "restart"
tc_serve --ublk
ublk_wait 0
mount /dev/ublkb0 "$MNT"
umount "$MNT"
fs_check ext4 /dev/ublkb0
mount /dev/ublkb0 "$MNT"
verify_files
umount "$MNT"
tc_stop
[ ! -e /sys/block/ublkb0 ] || die "/dev/ublkb0 is still there after the server stopped"

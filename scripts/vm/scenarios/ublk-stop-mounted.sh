# A stop that cannot finish in time: SIGTERM while ext4 is still mounted on /dev/ublkb0. The
# driver deletes the device only once the filesystem lets it go, so the server gives up on the
# delete at its deadline (--shutdown-timeout 3), says so, saves the cache and exits 0 instead
# of waiting for the unmount. The filesystem has lost its device; unmounted, the number is free
# again: the next serve --ublk is /dev/ublkb0, every file fsync'd before the stop is intact and
# the checker is clean.
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

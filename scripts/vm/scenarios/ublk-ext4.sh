# ext4 on /dev/ublkb0 (serve --ublk, two queues): the round trip (fio with verify, fsync'd files,
# the checker, read back), fstrim reaching tiercache, no failed request, and a clean stop that
# removes the device; after a restart the files are intact.
tc_make
tc_serve --ublk --ublk-queues 2
ublk_wait 0
[ "$(ls /sys/block/ublkb0/mq | wc -l)" = 2 ] || die "/dev/ublkb0 has not 2 queues"
fs_roundtrip ext4 /dev/ublkb0
mount /dev/ublkb0 "$MNT"
dd if=/dev/urandom of="$MNT/big" bs=1M count=32 conv=fsync 2> /dev/null
rm "$MNT/big"
sync
before=$(metric tiercache_volume_requests_total 'op="trim"')
fstrim -v "$MNT"
after=$(metric tiercache_volume_requests_total 'op="trim"')
say "trim requests: $before before fstrim, $after after"
[ "$after" -gt "$before" ] || die "fstrim sent no trim to tiercache"
umount "$MNT"
no_errors
tc_stop
[ ! -e /sys/block/ublkb0 ] || die "/dev/ublkb0 is still there after the server stopped"
say "restart"
tc_serve --ublk
ublk_wait 0
mount /dev/ublkb0 "$MNT"
verify_files
umount "$MNT"
fs_check ext4 /dev/ublkb0
tc_stop

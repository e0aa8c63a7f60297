# fstrim on ext4 over /dev/nbd0 reaches tiercache: the kernel sends NBD_CMD_TRIM and the
# server counts trim requests; the files that stay are intact afterwards.
tc_make
tc_serve
nbd_up
[ "$(cat /sys/block/nbd0/queue/discard_max_bytes)" != 0 ] || die "/dev/nbd0 does not take discards"
mkfs.ext4 -q -F -E nodiscard /dev/nbd0
mount /dev/nbd0 "$MNT"
make_files "$MNT/keep" 10 k
dd if=/dev/urandom of="$MNT/big" bs=1M count=64 conv=fsync 2> /dev/null
rm "$MNT/big"
sync
before=$(metric tiercache_volume_requests_total 'op="trim"')
fstrim -v "$MNT"
after=$(metric tiercache_volume_requests_total 'op="trim"')
say "trim requests: $before before fstrim, $after after"
[ "$after" -gt "$before" ] || die "fstrim sent no trim to tiercache"
verify_files
umount "$MNT"
fs_check ext4 /dev/nbd0
no_errors
nbd_down
tc_stop

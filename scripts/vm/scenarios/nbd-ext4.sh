# ext4 on /dev/nbd0 (nbd-client over the unix socket): the round trip with one connection, then
# a clean restart of the server, four connections (-C 4), the files read back, fio again and
# the checker.
tc_make
tc_serve
nbd_up
fs_roundtrip ext4 /dev/nbd0
nbd_down
tc_stop
say "restart, nbd-client -C 4"
tc_serve
nbd_up -C 4
c=$(metric "tiercache_connections{" unix)
[ "$c" = 4 ] || die "the server has $c connections, not 4"
mount /dev/nbd0 "$MNT"
verify_files
fio_verify "$MNT" --numjobs=4 --size=8m
rm -f "$MNT"/verify.*
umount "$MNT"
fs_check ext4 /dev/nbd0
no_errors
nbd_down
tc_stop

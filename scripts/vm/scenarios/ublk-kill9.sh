# User recovery: writeback, ext4 on /dev/ublkb0 written with fsync'd files while the server is
# killed (kill -9). The device stays; a new serve --ublk takes it over and the writer goes on
# without an error (the filesystem sees a pause). Then the checker is clean and every file
# whose fsync returned is intact.
tc_make --writeback
tc_serve --ublk
ublk_wait 0
errors0=$(kernel_io_errors)
mkfs.ext4 -q -F /dev/ublkb0
mount /dev/ublkb0 "$MNT"
make_files "$MNT/before" 20 b
( make_files "$MNT/during" 100000 d ) &
writer=$!
sleep 6
say "kill -9 of the server during writes ($(wc -l < "$SUMS") files fsync'd)"
tc_kill9
sleep 2
[ -b /dev/ublkb0 ] || die "/dev/ublkb0 went away with the server"
n1=$(wc -l < "$SUMS")
say "restart (recovery)"
tc_serve --ublk
grep -q 'taken over from a server that died' /tmp/serve.log || { tail -20 /tmp/serve.log; die "serve did not recover /dev/ublkb0"; }
sleep 6
kill -0 $writer 2> /dev/null || die "the writer stopped: an fsync or write failed across the restart"
n2=$(wc -l < "$SUMS")
say "files fsync'd: $n1 at the kill, $n2 after the recovery"
[ "$n2" -gt "$n1" ] || die "no file was written after the recovery"
touch /tmp/stop-writer
wait $writer || die "the writer failed"
errors1=$(kernel_io_errors)
[ "$errors1" = "$errors0" ] || die "the kernel logged I/O errors"
umount "$MNT"
fs_check ext4 /dev/ublkb0
mount /dev/ublkb0 "$MNT"
verify_files
umount "$MNT"
no_errors
tc_stop

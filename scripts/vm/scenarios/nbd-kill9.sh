# Writeback: ext4 on /dev/nbd0 written with fsync'd files while the server is killed (kill -9).
# The connection dies with it; the filesystem is unmounted, the server restarted, the device
# connected again: the journal replays, the checker finds nothing and every file whose fsync
# returned is intact.
tc_make --writeback
tc_serve
nbd_up
mkfs.ext4 -q -F /dev/nbd0
mount /dev/nbd0 "$MNT"
make_files "$MNT/before" 20 b
# Files fsync'd while the server dies: a writer in the background, killed with the server.
( make_files "$MNT/during" 100000 d ) > /dev/null 2>&1 &
writer=$!
sleep 8
dirty=$(tc status --json | grep -o '"dirty[a-z_]*": *[0-9]*' | head -3 | tr '\n' ' ')
say "kill -9 of the server during writes ($(wc -l < "$SUMS") files fsync'd; $dirty)"
tc_kill9
sleep 1
kill -9 $writer 2> /dev/null || true
wait $writer 2> /dev/null || true
umount "$MNT" 2> /dev/null || umount -l "$MNT"
nbd_down || true
say "restart"
tc_serve
nbd_up
mount /dev/nbd0 "$MNT"
umount "$MNT"
fs_check ext4 /dev/nbd0
mount /dev/nbd0 "$MNT"
verify_files
umount "$MNT"
nbd_down
tc_stop

# Mode switches while mounted and in use: fio with verify runs on ext4 over /dev/nbd0 while
# cache_mode goes round writeback, writearound, none and writethrough; fio verifies every
# block, the files stay intact and the checker is clean.
tc_make
tc_serve
nbd_up -C 2
mkfs.ext4 -q -F /dev/nbd0
mount /dev/nbd0 "$MNT"
make_files "$MNT/tree" 20 m
( fio_verify "$MNT" --size=32m ) &
fio=$!
for mode in writeback writearound none writethrough writeback writethrough; do
    sleep 2
    tc set data cache_mode $mode > /dev/null
    [ "$(tc get data cache_mode)" = "$mode" ] || die "cache_mode is $(tc get data cache_mode), not $mode"
    say "cache_mode $mode"
done
wait $fio || die "fio failed during the mode switches"
verify_files
rm -f "$MNT"/verify.*
umount "$MNT"
fs_check ext4 /dev/nbd0
no_errors
nbd_down
tc_stop

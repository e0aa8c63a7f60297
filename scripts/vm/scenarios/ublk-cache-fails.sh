# ublk: the cache device fails under a mounted, written ext4 in writethrough (see cache_fails).
cache_fails ublk

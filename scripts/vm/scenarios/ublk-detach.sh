# ublk: detach and attach of the volume under a mounted, written ext4 (see detach_in_use).
detach_in_use ublk writethrough

# NBD: detach and attach of the volume under a mounted ext4 written in writeback, with dirty
# data to write back while the writer goes on (see detach_in_use).
detach_in_use nbd writeback

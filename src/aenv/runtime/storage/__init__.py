"""Sandbox storage on the host, shared by backends: the btrfs pool (a subvolume and quota
per sandbox) or an ext4 image per sandbox."""

"""Volumes: named directories sandboxes mount (E2B's `/volumes` and `volumeMounts`), and
their file content API (`/volumecontent`)."""

from .files import EntryStat, VolumeFiles
from .store import VolumeRecord, VolumeStore, check_mount_path, check_volume_name

__all__ = [
    "EntryStat",
    "VolumeFiles",
    "VolumeRecord",
    "VolumeStore",
    "check_mount_path",
    "check_volume_name",
]

"""Which filesystem a path lives on, and the catalog's refusal of network filesystems.

The catalog's index is SQLite in WAL mode. WAL keeps its index in a shared-memory file (`-shm`) that every reader
and writer maps, and it relies on POSIX locks: both only work when every process is on one host and the filesystem
implements them faithfully. NFS, Lustre, SMB, GPFS, BeeGFS and FUSE network mounts do not promise either, so a
catalog there can be corrupted silently (SQLite's own documentation: "WAL does not work over a network
filesystem"). Runs may put `logging.root` on shared storage; the catalog must then live on a local disk of the
driver's node (`catalog.path`).

The filesystem of a path is the type of the mount with the longest mount point that is a prefix of the path's
resolved form, read from the mounts table (/proc/mounts on Linux; `$MINT_MOUNTS` names another table, for tests and
for containers whose /proc is not the host's). Without a readable table nothing is refused.
"""

from __future__ import annotations

import os
from pathlib import Path

from mint.errors import ConfigError

# Filesystem types (as /proc/mounts spells them) on which SQLite's WAL mode is unsafe.
NETWORK_FS = frozenset(
    {
        "nfs",
        "nfs4",
        "lustre",
        "cifs",
        "smb3",
        "smbfs",
        "gpfs",
        "beegfs",
        "ceph",
        "glusterfs",
        "afs",
        "9p",
        "panfs",
        "wekafs",
        "pvfs2",
        "orangefs",
        "fuse.sshfs",
        "fuse.glusterfs",
        "fuse.ceph",
        "fuse.cephfs",
        "fuse.s3fs",
        "fuse.gcsfuse",
        "fuse.juicefs",
        "fuse.rclone",
        "fuse.davfs",
    }
)
MOUNTS = "/proc/mounts"


def _unescape(field: str) -> str:
    """/proc/mounts writes space, tab, newline and backslash in paths as octal escapes (\\040 ...)."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def read_mounts(mounts_file: str | None = None) -> list[tuple[str, str]]:
    """(mount point, filesystem type) of every line of the mounts table; [] when it cannot be read."""
    path = mounts_file or os.environ.get("MINT_MOUNTS") or MOUNTS
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    table = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 3:
            table.append((_unescape(fields[1]), fields[2]))
    return table


def filesystem_of(path: str | Path, mounts_file: str | None = None) -> tuple[str, str] | None:
    """(mount point, filesystem type) of the mount holding `path` (which need not exist yet); None when unknown.

    The path is made absolute and its symlinks resolved (a link into an NFS mount is on NFS). Of the mounts whose
    point is a prefix of it, whole components only (/mnt/a does not hold /mnt/ab), the longest wins; a later line
    for the same point wins, as the kernel lists mounts in the order they stack."""
    resolved = os.path.realpath(os.path.abspath(os.path.expanduser(str(path))))
    best: tuple[str, str] | None = None
    for point, fstype in read_mounts(mounts_file):
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, fstype)
    return best


def is_network_fs(fstype: str) -> bool:
    return fstype in NETWORK_FS or fstype.startswith("nfs")


def require_local_fs(path: str | Path, what: str = "the catalog", mounts_file: str | None = None) -> None:
    """Raise ConfigError (one line naming the fix) when `path` is on a network filesystem."""
    found = filesystem_of(path, mounts_file)
    if found is not None and is_network_fs(found[1]):
        point, fstype = found
        raise ConfigError(
            f"{what} {path} is on {fstype} (mounted at {point}), where SQLite's WAL mode is unsafe; put it on a "
            "local disk of this node: set catalog.path to a local path, e.g. /var/tmp/mint/catalog (logging.root "
            "may stay on shared storage)"
        )

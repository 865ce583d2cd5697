"""Whether a run directory is on storage every node of a job can see (a warning, not a guess)."""
from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Sequence
from pathlib import Path

__all__ = ["SHARED_FILESYSTEMS", "filesystem", "warn_if_not_shared"]

#: Filesystem types that several hosts mount (network and cluster filesystems).
SHARED_FILESYSTEMS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "glusterfs",
                      "cifs", "smb3", "smbfs", "fuse.gcsfuse", "fuse.sshfs", "fuse.s3fs",
                      "fuse.juicefs", "fuse.glusterfs", "fuse.cephfs", "fuse.weka", "wekafs",
                      "panfs", "pvfs2", "orangefs", "afs", "9p", "virtiofs", "fuse.geesefs")


def filesystem(path: Path) -> tuple[str, str]:
    """(mount point, filesystem type) of the mount holding ``path`` (from /proc/mounts)."""
    real = os.path.realpath(path if path.exists() else path.parent)
    best = ("/", "unknown")
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1].replace("\\040", " ")
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best[0]):
            best = (mount, parts[2])
    return best


def _is_this_host(name: str) -> bool:
    me = {socket.gethostname(), socket.gethostname().split(".")[0], socket.getfqdn(),
          "localhost", "127.0.0.1", "::1"}
    return name in me or name.split(".")[0] in me


def warn_if_not_shared(run_dir: Path, hosts: Sequence[str]) -> None:
    """Warns when ``run_dir`` sits on a local filesystem but ``hosts`` include other machines.

    The workers write checkpoints and metrics there and the notebook reads them back, so
    every host must see the same directory.
    """
    others = [h for h in hosts if not _is_this_host(h)]
    if not others:
        return
    probe = Path(run_dir)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    mount, fstype = filesystem(probe)
    if fstype in SHARED_FILESYSTEMS or fstype.startswith("fuse."):
        return
    warnings.warn(f"run directory {run_dir} is on a local {fstype!r} filesystem (mounted at "
                  f"{mount}), but the job runs on other hosts ({', '.join(others[:4])}"
                  f"{', ...' if len(others) > 4 else ''}), which will not see its checkpoints "
                  "and metrics. Use a run_dir on shared storage (NFS, Lustre, GPFS, a "
                  f"gcsfuse bucket ...). Check with `df -T {run_dir}` here and `ls {run_dir}` "
                  f"on a node (e.g. `srun -N1 ls {run_dir}` or `ssh {others[0]} ls {run_dir}`)",
                  stacklevel=4)

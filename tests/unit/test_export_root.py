"""Where the weight exports go: shared memory when every server can read it and it has room
for the versions kept, else the configured folder."""

from __future__ import annotations

import shutil

from workers.trainer import weights

LOCAL = ["http://127.0.0.1:8100", "http://localhost:8101"]


def test_exports_go_to_shared_memory_when_they_fit(tmp_path):
    shm, disk = tmp_path / "shm", tmp_path / "w"
    shm.mkdir()
    root = weights.export_root(disk, True, LOCAL, 1 << 20, keep=2, shm=shm)
    assert root.parent == shm and root.name.startswith("carryover-weights-")
    # another deployment's weights_dir gets its own folder, and this one's stays
    other = weights.export_root(tmp_path / "w2", True, LOCAL, 1, 2, shm=shm)
    assert other != root and other.exists() and root.exists()
    assert weights.export_root(disk, True, LOCAL, 1 << 20, keep=2, shm=shm) == root


def test_exports_stay_on_disk_otherwise(tmp_path):
    shm, disk = tmp_path / "shm", tmp_path / "w"
    shm.mkdir()
    free = shutil.disk_usage(shm).free
    # keep 2 versions plus the one being written: three exports must fit
    assert weights.export_root(disk, True, LOCAL, free // 2, keep=2, shm=shm) == disk
    # and host memory must hold them too (tmpfs pages are memory)
    avail, _ = weights._meminfo()
    assert weights.export_root(disk, True, LOCAL, avail // 2, keep=2, shm=shm) == disk
    # a server on another host cannot read this host's memory
    assert weights.export_root(disk, True, [*LOCAL, "http://10.0.0.7:8100"], 1, 2,
                               shm=shm) == disk
    assert weights.export_root(disk, False, LOCAL, 1, 2, shm=shm) == disk
    assert weights.export_root(disk, True, LOCAL, 1, 2, shm=tmp_path / "none") == disk


def test_a_gone_deployments_exports_are_freed(tmp_path):
    """Shared memory is host memory: the folder of a weights_dir that no longer exists (a
    test's temporary one) is removed the next time any deployment picks its folder."""
    shm, disk = tmp_path / "shm", tmp_path / "w"
    shm.mkdir()
    gone_dir = tmp_path / "gone"
    gone_dir.mkdir()
    gone = weights.export_root(gone_dir, True, LOCAL, 1, 2, shm=shm)
    (gone / "v000001").mkdir()
    mine = weights.export_root(disk, True, LOCAL, 1, 2, shm=shm)
    assert gone.exists()   # its weights_dir still exists
    gone_dir.rmdir()
    assert weights.export_root(disk, True, LOCAL, 1, 2, shm=shm) == mine
    assert not gone.exists() and mine.exists()

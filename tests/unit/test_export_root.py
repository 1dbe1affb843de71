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


def _versions(root):
    return sorted(p.name for p in root.iterdir() if p.name.startswith("v"))


def test_the_published_version_outlives_a_failed_one(tmp_path):
    """With one version kept, writing the next must not delete the published one before
    the next is verified: a failed step would leave the keeper nothing to load into a
    restarted server. Exports never number more than the versions kept plus one, and
    once a version is verified, the versions kept."""
    most = [0]

    def write(tmp):
        (tmp / "model.safetensors").write_bytes(b"w")
        most[0] = max(most[0], len(_versions(tmp_path)) + 1)   # the one being written too

    v1 = weights.publish_version(tmp_path, 1, 1, write)
    v2 = weights.publish_version(tmp_path, 2, 1, write, published=v1)   # its load fails
    assert _versions(tmp_path) == ["v000001", "v000002"] and v1.is_dir()
    # the retry exports the same number again (no version was bumped): still two at most
    assert weights.publish_version(tmp_path, 2, 1, write, published=v1) == v2
    assert _versions(tmp_path) == ["v000001", "v000002"] and most[0] == 2
    v3 = weights.publish_version(tmp_path, 3, 1, write, published=v1)   # the retry
    assert _versions(tmp_path) == ["v000001", "v000003"] and not v2.exists()
    weights.prune_versions(tmp_path, 1)                                 # v3 was verified
    assert _versions(tmp_path) == ["v000003"] and v3.is_dir()
    for version, keep in ((4, 2), (5, 2), (6, 2)):
        weights.publish_version(tmp_path, version, keep, write,
                                published=tmp_path / f"v{version - 1:06d}")
        weights.prune_versions(tmp_path, keep)
    assert _versions(tmp_path) == ["v000005", "v000006"] and most[0] == 2

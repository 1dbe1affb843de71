"""The checks on vLLM's ``/weight_checker`` digests after a weight transfer: every
data-parallel replica holds the same tensors, and an update that moved the weights changed
them; the digests of tensors vLLM CPU keeps empty (repacked linear layers) prove nothing."""

from __future__ import annotations

import pytest

from app.services.transfer_wire import ShmBucket, aligned
from workers.trainer import weights

EMPTY = weights.EMPTY_DIGEST


def digests(dp: int, values: dict[str, str]) -> dict[str, str]:
    return {f"dp{d}:pp0:pcp0:tp0:{k}": v for d in range(dp) for k, v in values.items()}


def test_replicas_that_agree_and_changed_tensors_pass_with_their_counts():
    old = digests(2, {"embed": "a", "norm": "b", "qkv": EMPTY})
    new = digests(2, {"embed": "c", "norm": "b", "qkv": EMPTY})
    assert weights.check_checksums("http://s", new, old, must_change=True) == {
        "weight_sync/checksummed_tensors": 4.0, "weight_sync/changed_tensors": 2.0}
    # the first load of a server: nothing to compare with
    assert weights.check_checksums("http://s", new, None, must_change=True)[
        "weight_sync/changed_tensors"] == 0.0


def test_a_replica_that_missed_the_load_fails_naming_the_tensor():
    got = digests(2, {"embed": "c", "norm": "b"})
    got["dp1:pp0:pcp0:tp0:embed"] = "a"
    with pytest.raises(weights.WeightSyncError, match="replicas hold different weights for "
                                                      "1 tensor.*pp0:pcp0:tp0:embed"):
        weights.check_checksums("http://s", got, None, must_change=False)


def test_a_load_that_changed_nothing_fails_only_when_the_update_moved_the_weights():
    old = digests(1, {"embed": "a", "qkv": EMPTY})
    with pytest.raises(weights.WeightSyncError, match="every one of the 1 checksummed"):
        weights.check_checksums("http://s", dict(old), old, must_change=True)
    # a step too small to move the bf16 weights (the probe did not move either)
    assert weights.check_checksums("http://s", dict(old), old, must_change=False)[
        "weight_sync/changed_tensors"] == 0.0


def test_a_bucket_names_a_plain_file_and_one_entry_per_tensor():
    ShmBucket("bucket-00000", ["a"], ["bfloat16"], [[2]], [0], 4).check()
    for bad in ("../etc/passwd", "/dev/shm/x", ".hidden", ""):
        with pytest.raises(ValueError, match="not a plain file name"):
            ShmBucket(bad, ["a"], ["bfloat16"], [[2]], [0], 4).check()
    with pytest.raises(ValueError, match="one entry per tensor"):
        ShmBucket("b", ["a", "b"], ["bfloat16"], [[2]], [0], 4).check()
    assert [aligned(n) for n in (0, 1, 64, 65)] == [0, 64, 64, 128]

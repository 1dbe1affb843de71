"""Which complete groups a step trains: a pure function of the ready set, no Redis.

Oldest dispatch first: a group's score is its dispatch sequence number, so the groups that
have waited longest (and so carry the stalest rollouts) are consumed first and no complete
group can be passed over forever. ``Collector.select`` reads the ready set, asks this
module, and moves the chosen groups in one transaction.
"""

from __future__ import annotations

from collections.abc import Sequence


def oldest_first(ready: Sequence[tuple[str, float]], batch_size: int) -> list[str]:
    """The ``batch_size`` group ids with the lowest dispatch sequence (ties: by id, so the
    choice never depends on the order Redis returned them in)."""
    if batch_size <= 0:
        return []
    return [gid for gid, _ in sorted(ready, key=lambda item: (item[1], item[0]))[:batch_size]]

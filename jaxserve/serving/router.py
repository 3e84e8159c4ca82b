"""Which data-parallel replica a new request goes to: the least loaded, unless another holds
its prompt's prefix in cache and is not much busier.

Data flow: a request's prompt token ids -> `hash_pages` (the same chained page digests the
replicas' allocators cache prefixes under) -> for each replica, the longest run of those
digests the router has sent it before -> `choose(loads, hashes)` -> a Route -> the caller
submits there (or elsewhere if that replica's queue is full) -> `record(route, replica)`: the
replica that admitted the request takes the prompt's digests (least recently routed forgotten
first, bounded by that replica's page count, so the record approximates what its prefix cache
can still hold).

The record is the router's own: it never reads a replica's allocator, which belongs to that
replica's engine thread. It can be wrong when a replica evicted a prefix early; the cost is a
recomputed prefix, never a wrong answer.

Policy: with `m` the most matched pages of any replica and `b` such a replica (the least
loaded among ties), `b` is chosen when `m > 0` and `load[b] <= min(load) + slack`; otherwise
the least loaded replica (ties rotate, so a burst of equal loads spreads). Loads are requests
in flight. Plain Python: importable and testable without jax.
"""

from __future__ import annotations

import collections
import dataclasses
import struct
from typing import TYPE_CHECKING, Sequence

from jaxserve.engine.block_allocator import hash_pages

if TYPE_CHECKING:
    from jaxserve.engine.engine import Engine


@dataclasses.dataclass(frozen=True)
class Route:
    replica: int
    hashes: tuple[bytes, ...]  # the prompt's full-page digests (empty: routed by load only)
    by_prefix: bool  # sent past a less loaded replica for its cached prefix


class ReplicaRouter:
    def __init__(self, num_replicas: int, page_size: int, capacity_pages: int,
                 prefix_aware: bool = True, slack: int = 4) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas} must be >= 1")
        if slack < 0:
            raise ValueError(f"slack={slack} must be >= 0")
        self.num_replicas = num_replicas
        self.page_size = page_size
        self.capacity_pages = capacity_pages
        self.prefix_aware = prefix_aware
        self.slack = slack
        self._records: list[collections.OrderedDict[bytes, None]] = [
            collections.OrderedDict() for _ in range(num_replicas)]
        self._next = 0  # where the search for the least loaded starts (rotates on ties)
        self.prefix_routed = 0  # requests sent to a replica for its cached prefix

    def page_hashes(self, token_ids: Sequence[int] | None) -> tuple[bytes, ...]:
        """The digests to route by (pure: call it outside any lock). Empty for text, with
        prefix routing off, or for ids that are not token ids at all (the engine then refuses
        the request with an error naming the bad id)."""
        if not self.prefix_aware or token_ids is None:
            return ()
        try:
            return tuple(hash_pages(list(token_ids), self.page_size))
        except (struct.error, TypeError, OverflowError):
            return ()

    def choose(self, loads: Sequence[int], hashes: Sequence[bytes] = ()) -> Route:
        """Where a request with these page digests should go. Nothing is recorded until
        `record` says where it went."""
        if len(loads) != self.num_replicas:
            raise ValueError(f"got {len(loads)} loads for {self.num_replicas} replicas")
        order = [(self._next + k) % self.num_replicas for k in range(self.num_replicas)]
        least = min(order, key=lambda i: loads[i])
        self._next = (least + 1) % self.num_replicas
        if hashes:
            matched = [self._matched(i, hashes) for i in range(self.num_replicas)]
            best = max(order, key=lambda i: (matched[i], -loads[i]))
            if matched[best] > 0 and loads[best] <= loads[least] + self.slack:
                return Route(best, tuple(hashes), best != least)
        return Route(least, tuple(hashes), False)

    def record(self, route: Route, replica: int) -> None:
        """The request of `route` was admitted by `replica` (the chosen one, or another when
        the chosen one was full): that replica now caches its prefix."""
        if replica == route.replica and route.by_prefix:
            self.prefix_routed += 1
        record = self._records[replica]
        for h in route.hashes:
            record[h] = None
            record.move_to_end(h)
        while len(record) > self.capacity_pages:
            record.popitem(last=False)

    def _matched(self, replica: int, hashes: Sequence[bytes]) -> int:
        record = self._records[replica]
        n = 0
        for h in hashes:
            if h not in record:
                break
            n += 1
        return n


def make_router(engines: Sequence["Engine"]) -> ReplicaRouter:
    """The router over these replicas, sized from the first one's limits (all are alike)."""
    e = engines[0]
    # Slack: a replica holding a prompt's prefix may run a quarter of a full batch more
    # requests than the least loaded before load wins: recomputing a prefix costs less than
    # queueing behind a full replica.
    return ReplicaRouter(len(engines), e.limits.page_size, e.limits.num_kv_pages,
                         prefix_aware=e.config.enable_prefix_caching,
                         slack=max(1, e.config.max_num_seqs // 4))

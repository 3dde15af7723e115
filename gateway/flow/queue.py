"""The flow-control queue: priority bands, fair across tenants within a band, bounded.

Order: the band of the lowest ``priority`` value first (vLLM's order). Within a band,
tenants take turns by *virtual time* (the virtual token counter of VTC, Sheng et al.,
OSDI '24): each backlogged tenant carries the weighted cost it has been served,
``served / weight``, and the tenant with the least goes next; a tenant that becomes
backlogged starts at the band's current virtual time, so idling earns no credit. For two
tenants backlogged over an interval, their weighted service differs by at most one
request's cost / weight. A tenant's own requests leave in arrival order.

Bounds: at most ``max_total`` requests in all and ``max_per_priority`` per band. A request
that finds its band or the whole queue full displaces the newest request of the tenant
with the most queued in the worst band that is not better than its own (the lowest class
is shed first; within it, the heaviest tenant), provided that tenant queues more than the
newcomer's own tenant; otherwise the newcomer is refused. Memory is O(queued requests):
a tenant's state lives only while it has requests queued.

Pure: no I/O, no clock (deadlines are numbers the caller compares with its clock).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class FlowItem:
    """One queued request: who, how urgent, what it costs, until when it may wait."""

    id: str
    tenant: str
    priority: int
    cost: float
    enqueued: float
    deadline: float
    handle: object = None
    """The driver's own object (a future in the gateway, a record in the simulator)."""
    payload: object = None
    """What the saturation check needs to know about the request (its ``RequestInfo``)."""
    seq: int = 0


@dataclass(slots=True)
class _Band:
    tenants: dict[str, deque[FlowItem]] = field(default_factory=dict)
    vtime: dict[str, float] = field(default_factory=dict)
    heap: list[tuple[float, int, str]] = field(default_factory=list)
    stamp: dict[str, int] = field(default_factory=dict)
    floor: float = 0.0
    count: int = 0


class FairQueue:
    """Priority bands of per-tenant FIFOs, served by least weighted virtual time."""

    def __init__(
        self,
        *,
        max_total: int = 2_000,
        max_per_priority: int = 1_000,
        weights: Mapping[str, float] | None = None,
    ) -> None:
        if max_total < 1 or max_per_priority < 1:
            raise ValueError("queue bounds must be positive")
        self.max_total = max_total
        self.max_per_priority = max_per_priority
        self.weights = dict(weights or {})
        self._bands: dict[int, _Band] = {}
        self._by_id: dict[str, FlowItem] = {}
        self._deadlines: list[tuple[float, int, str]] = []
        self._seq = 0

    # -- queries ---------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._by_id

    def __iter__(self) -> Iterator[FlowItem]:
        return iter(list(self._by_id.values()))

    def get(self, item_id: str) -> FlowItem | None:
        return self._by_id.get(item_id)

    def count(self, priority: int) -> int:
        band = self._bands.get(priority)
        return band.count if band is not None else 0

    def priorities(self) -> list[int]:
        return sorted(self._bands)

    def tenant_count(self, priority: int, tenant: str) -> int:
        band = self._bands.get(priority)
        if band is None:
            return 0
        q = band.tenants.get(tenant)
        return len(q) if q is not None else 0

    def weight(self, tenant: str) -> float:
        w = self.weights.get(tenant, 1.0)
        return w if w > 0 else 1.0

    # -- changes ---------------------------------------------------------------
    def offer(self, item: FlowItem) -> tuple[bool, FlowItem | None]:
        """Queue ``item``: (queued, the request displaced to make room or None).

        ``(False, None)``: refused, nothing changed.
        """
        if item.id in self._by_id:
            raise ValueError(f"request {item.id!r} is already queued")
        victim: FlowItem | None = None
        band_full = self.count(item.priority) >= self.max_per_priority
        if band_full or len(self._by_id) >= self.max_total:
            victim = self._victim(item, same_band_only=band_full)
            if victim is None:
                return False, None
            self.remove(victim.id)
        self._push(item)
        return True, victim

    def _victim(self, item: FlowItem, *, same_band_only: bool) -> FlowItem | None:
        """The newest request of the heaviest tenant of the worst band not better than
        ``item``'s, if that tenant queues more than ``item``'s tenant (in its own band)."""
        bands = [item.priority] if same_band_only else sorted(self._bands, reverse=True)
        for prio in bands:
            if prio < item.priority:
                break
            band = self._bands.get(prio)
            if band is None or not band.count:
                continue
            heaviest = max(band.tenants, key=lambda t: (len(band.tenants[t]), t))
            mine = self.tenant_count(item.priority, item.tenant) + 1 if prio == item.priority else 0
            if prio > item.priority or len(band.tenants[heaviest]) > mine:
                return band.tenants[heaviest][-1]
            if same_band_only:
                return None
        return None

    def _push(self, item: FlowItem) -> None:
        self._seq += 1
        item.seq = self._seq
        band = self._bands.get(item.priority)
        if band is None:
            band = self._bands[item.priority] = _Band()
        q = band.tenants.get(item.tenant)
        if q is None:  # newly backlogged: start at the band's virtual time (no idle credit)
            q = band.tenants[item.tenant] = deque()
            band.vtime[item.tenant] = band.floor
            self._schedule(band, item.tenant)
        q.append(item)
        band.count += 1
        self._by_id[item.id] = item
        heapq.heappush(self._deadlines, (item.deadline, item.seq, item.id))

    @staticmethod
    def _schedule(band: _Band, tenant: str) -> None:
        stamp = band.stamp.get(tenant, 0) + 1
        band.stamp[tenant] = stamp
        heapq.heappush(band.heap, (band.vtime[tenant], stamp, tenant))
        if len(band.heap) > 4 * len(band.tenants) + 64:  # drop stale turns: bounded memory
            band.heap = [e for e in band.heap if band.stamp.get(e[2]) == e[1]]
            heapq.heapify(band.heap)

    def _head_tenant(self, band: _Band) -> str | None:
        heap = band.heap
        while heap:
            _vt, stamp, tenant = heap[0]
            if tenant in band.tenants and band.stamp.get(tenant) == stamp:
                return tenant
            heapq.heappop(heap)  # stale: the tenant was served or left since
        return None

    def peek(self) -> FlowItem | None:
        """The request that leaves next, or None when empty."""
        for prio in sorted(self._bands):
            band = self._bands[prio]
            tenant = self._head_tenant(band)
            if tenant is not None:
                return band.tenants[tenant][0]
        return None

    def pop(self) -> FlowItem | None:
        """Take the next request out (its tenant's virtual time advances by its cost)."""
        item = self.peek()
        if item is None:
            return None
        band = self._bands[item.priority]
        vt = band.vtime[item.tenant]
        band.floor = max(band.floor, vt)
        band.vtime[item.tenant] = vt + item.cost / self.weight(item.tenant)
        self._unlink(band, item)
        if item.tenant in band.tenants:
            self._schedule(band, item.tenant)
        return item

    def remove(self, item_id: str) -> FlowItem | None:
        """Take a request out wherever it is (client gone, timed out, shed)."""
        item = self._by_id.get(item_id)
        if item is None:
            return None
        band = self._bands[item.priority]
        self._unlink(band, item)
        return item

    def _unlink(self, band: _Band, item: FlowItem) -> None:
        q = band.tenants[item.tenant]
        if q and q[0] is item:
            q.popleft()
        else:
            q.remove(item)
        band.count -= 1
        del self._by_id[item.id]
        if not q:
            del band.tenants[item.tenant]
            del band.vtime[item.tenant]
            band.stamp.pop(item.tenant, None)
        if not band.count:
            del self._bands[item.priority]
        if not self._by_id:
            self._deadlines.clear()

    def expired(self, now: float) -> list[FlowItem]:
        """Remove and return the requests whose deadline is at or before ``now``."""
        out: list[FlowItem] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, seq, item_id = heapq.heappop(heap)
            item = self._by_id.get(item_id)
            if item is not None and item.seq == seq:
                self.remove(item_id)
                out.append(item)
        if len(heap) > 4 * len(self._by_id) + 64:  # drop stale entries: memory stays bounded
            self._deadlines = [e for e in heap if self._live(e)]
            heapq.heapify(self._deadlines)
        return out

    def _live(self, entry: tuple[float, int, str]) -> bool:
        item = self._by_id.get(entry[2])
        return item is not None and item.seq == entry[1]

    def next_deadline(self) -> float | None:
        """The earliest deadline of a queued request (None when empty)."""
        heap = self._deadlines
        while heap and not self._live(heap[0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

"""Preble's global radix tree over chained block hashes, with bounded memory.

Each node holds a run of block hashes (its edge label), the engines caching
it (with how many of its leading blocks each one still holds), the times of
the requests that used it within the window ``H`` (per engine), its last
access, its depth (blocks from the root), and recent output lengths and
TTFTs of requests through it. Invariant: an engine listed on a node holds
all of its ancestors whole, and is listed on a child only if it holds the
whole node; so an engine's cached prefix of a prompt is the path down to the
deepest path node that lists it. Evictions shorten an engine's
held length on a node instead of splitting it, so the tree does not fragment
as engines evict blocks one at a time.

Memory is bounded by ``max_blocks``: past it, least-recently-used leaves go
first, leaves no engine caches before cached ones. A node no engine caches
and no request used within ``H`` is dropped when its last use expires.
Everything is driven by the ``now`` the caller passes; nothing reads a clock.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence

EngineId = str


class Node:
    """One run of blocks in the tree."""

    __slots__ = (
        "__weakref__",
        "blocks",
        "children",
        "depth",
        "engines",
        "hits",
        "last_access",
        "outputs",
        "parent",
        "ttfts",
    )

    def __init__(self, blocks: list[int], parent: Node | None, depth: int, now: float) -> None:
        self.blocks = blocks
        self.parent = parent
        self.depth = depth
        self.children: dict[int, Node] = {}
        self.engines: dict[EngineId, int] = {}
        self.hits: dict[EngineId, deque[float]] = {}
        self.last_access = now
        self.outputs: deque[int] = deque(maxlen=8)
        self.ttfts: deque[tuple[float, float]] = deque(maxlen=32)

    @property
    def end(self) -> int:
        """Blocks from the root to the end of this node."""
        return self.depth + len(self.blocks)

    def count(self, since: float, engine: EngineId | None = None) -> int:
        """Requests through this node at or after ``since`` (for one engine or all)."""
        if engine is not None:
            times = self.hits.get(engine)
            return 0 if times is None else _count_since(times, since)
        return sum(_count_since(times, since) for times in self.hits.values())

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"Node(depth={self.depth}, blocks={len(self.blocks)}, engines={self.engines})"


def _count_since(times: deque[float], since: float) -> int:
    while times and times[0] < since:
        times.popleft()
    return len(times)


class Match:
    """The longest match of a prompt: the path and each engine's cached length."""

    __slots__ = ("blocks", "last_partial", "path", "per_engine")

    def __init__(self) -> None:
        self.path: list[Node] = []
        self.blocks = 0
        self.last_partial = 0
        self.per_engine: dict[EngineId, int] = {}


class RadixTree:
    """The global prefix tree of Preble's scheduler."""

    def __init__(self, *, window_s: float = 180.0, max_blocks: int = 1_000_000) -> None:
        if max_blocks <= 0 or window_s <= 0:
            raise ValueError("max_blocks and window_s must be positive")
        self.window_s = window_s
        self.max_blocks = max_blocks
        self.root = Node([], None, 0, 0.0)
        self._index: dict[int, Node] = {}
        self._num_nodes = 0
        self._lru: dict[EngineId, OrderedDict[Node, None]] = {}
        self._cached: dict[EngineId, int] = {}
        self._leaves_cold: OrderedDict[Node, None] = OrderedDict()
        self._leaves_warm: OrderedDict[Node, None] = OrderedDict()
        self._expiry: deque[tuple[float, weakref.ref[Node]]] = deque()
        self._orphans: list[Node] = []  # nodes that lost their last engine: GC candidates

    # -- queries -------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self._index)

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    def cached_blocks(self, engine: EngineId) -> int:
        return self._cached.get(engine, 0)

    def node_of(self, block_hash: int) -> Node | None:
        return self._index.get(block_hash)

    def nodes(self) -> Iterator[Node]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def match(self, hashes: Sequence[int]) -> Match:
        """Walk the prompt down the tree; never changes the tree."""
        out = Match()
        node, i, n = self.root, 0, len(hashes)
        while i < n:
            child = node.children.get(hashes[i])
            if child is None:
                break
            m = _common(child.blocks, hashes, i)
            out.path.append(child)
            i += m
            if m < len(child.blocks):
                out.last_partial = m
                break
            node = child
        out.blocks = i
        # Engine sets shrink down a path (a child lists only engines holding its parent
        # whole), so walking up, each engine is met first at its deepest node.
        per = out.per_engine
        for k in range(len(out.path) - 1, -1, -1):
            node = out.path[k]
            if len(node.engines) <= len(per):
                continue
            m = (
                out.last_partial
                if k == len(out.path) - 1 and out.last_partial
                else len(node.blocks)
            )
            for engine, held in node.engines.items():
                if engine not in per:
                    per[engine] = node.depth + min(m, held)
        return out

    def lru_nodes(self, engine: EngineId) -> Iterator[Node]:
        """An engine's cached nodes, least recently used first (leaves before their parents)."""
        return iter(self._lru.get(engine, ()))

    # -- updates -------------------------------------------------------------
    def insert(self, hashes: Sequence[int], now: float) -> list[Node]:
        """Add the prompt's blocks (splitting nodes as needed); returns the full path."""
        path: list[Node] = []
        node, i, n = self.root, 0, len(hashes)
        while i < n:
            child = node.children.get(hashes[i])
            if child is None:
                leaf = Node(list(hashes[i:]), node, i, now)
                node.children[hashes[i]] = leaf
                for h in leaf.blocks:
                    self._index[h] = leaf
                self._num_nodes += 1
                self._refresh_leaf(node)
                self._refresh_leaf(leaf)
                path.append(leaf)
                break
            m = _common(child.blocks, hashes, i)
            if m < len(child.blocks):
                child = self._split(child, m)
            path.append(child)
            node = child
            i += m
        self._enforce_bound(protect=path)
        return path

    def record(self, path: Sequence[Node], engine: EngineId, now: float) -> None:
        """A request for ``engine`` used these nodes now."""
        horizon = now - self.window_s
        for node in path:
            times = node.hits.get(engine)
            if times is None:
                times = node.hits[engine] = deque()
            while times and times[0] < horizon:
                times.popleft()
            times.append(now)
            node.last_access = now
            self._expiry.append((now, weakref.ref(node)))  # refs to one node are one object
        if len(self._expiry) > self.max_blocks:
            # Bounded: the oldest entries go unprocessed; their nodes still leave through the
            # block bound (LRU), only their time-based removal is lost.
            for _ in range(len(self._expiry) - self.max_blocks):
                self._expiry.popleft()
        self._touch(path, now)

    def add_engine(self, path: Sequence[Node], engine: EngineId, now: float) -> None:
        """``engine`` now caches the nodes of ``path`` (a prefix path from the root)."""
        lru = self._lru.setdefault(engine, OrderedDict())
        for node in path:
            held = node.engines.get(engine, 0)
            if held < len(node.blocks):
                if not held:
                    lru[node] = None
                node.engines[engine] = len(node.blocks)
                self._cached[engine] = self._cached.get(engine, 0) + len(node.blocks) - held
                if not node.children:
                    self._refresh_leaf(node)
        self._touch(path, now)

    def remove_blocks(self, engine: EngineId, hashes: Iterable[int]) -> int:
        """``engine`` evicted these blocks: it no longer caches them or anything below.

        Returns how many blocks the tree stopped attributing to the engine.
        """
        dropped = 0
        # Group by node: one pass over each node's blocks however many of them were evicted.
        groups: dict[int, tuple[Node, set[int]]] = {}
        for h in hashes:
            node = self._index.get(h)
            if node is not None and node.engines.get(engine, 0):
                groups.setdefault(id(node), (node, set()))[1].add(h)
        for node, evicted in groups.values():
            held = node.engines.get(engine, 0)
            k = next((i for i, b in enumerate(node.blocks[:held]) if b in evicted), None)
            if k is None:
                continue
            if k == 0:
                dropped += self._drop_engine_subtree(node, engine)
                continue
            node.engines[engine] = k
            self._cached[engine] -= held - k
            dropped += held - k
            for child in list(node.children.values()):
                dropped += self._drop_engine_subtree(child, engine)
        return dropped

    def held(self, node: Node, engine: EngineId) -> int:
        """How many leading blocks of ``node`` the tree attributes to ``engine``."""
        return node.engines.get(engine, 0)

    def evict_lru(self, engine: EngineId, blocks: int) -> int:
        """Forget ``engine``'s least recently used nodes until ``blocks`` are freed."""
        freed = 0
        lru = self._lru.get(engine)
        while lru and freed < blocks:
            node = next(iter(lru))
            freed += self._drop_engine_subtree(node, engine)
        return freed

    def remove_engine(self, engine: EngineId) -> None:
        for node in list(self._lru.pop(engine, ())):
            node.engines.pop(engine, None)
            if not node.engines:
                self._orphans.append(node)
            if not node.children:
                self._refresh_leaf(node)
        for node in self.nodes():
            node.hits.pop(engine, None)
        self._cached.pop(engine, None)

    def expire(self, now: float) -> None:
        """Drop nodes that no engine caches and no request used within the window."""
        horizon = now - self.window_s
        queue = self._expiry
        while queue and queue[0][0] < horizon:
            _, ref = queue.popleft()
            node = ref()
            if node is not None:  # None: removed from the tree (bound) and freed meanwhile
                self._maybe_drop(node, horizon)
        orphans, self._orphans = self._orphans, []
        for node in orphans:
            if node.parent is not None:  # still in the tree
                self._maybe_drop(node, horizon)

    # -- internals -------------------------------------------------------------
    def _touch(self, path: Sequence[Node], now: float) -> None:
        for node in reversed(path):  # leaves older than their parents in every LRU
            node.last_access = now
            for engine in node.engines:
                self._lru[engine].move_to_end(node)
            if not node.children:
                self._refresh_leaf(node)

    def _split(self, node: Node, k: int) -> Node:
        """Cut ``node`` after ``k`` blocks: a new head node takes them; returns the head."""
        parent = node.parent
        assert parent is not None and 0 < k < len(node.blocks)
        head = Node(node.blocks[:k], parent, node.depth, node.last_access)
        head.engines = {e: min(held, k) for e, held in node.engines.items()}
        for e, held in list(node.engines.items()):
            if held > k:
                node.engines[e] = held - k
            else:
                del node.engines[e]
                self._lru[e].pop(node, None)
        if not node.engines and head.engines:
            self._orphans.append(node)
        head.hits = {e: deque(t) for e, t in node.hits.items()}
        head.outputs = deque(node.outputs, maxlen=node.outputs.maxlen)
        head.ttfts = deque(node.ttfts, maxlen=node.ttfts.maxlen)
        parent.children[head.blocks[0]] = head
        node.blocks = node.blocks[k:]
        node.parent = head
        node.depth += k
        head.children[node.blocks[0]] = node
        for h in head.blocks:
            self._index[h] = head
        for engine in head.engines:
            lru = self._lru[engine]
            lru[head] = None  # the head sits just after the tail in LRU order
        self._num_nodes += 1
        if not node.children:
            self._refresh_leaf(node)
        if head.hits:
            self._expiry.append((head.last_access, weakref.ref(head)))
        return head

    def _drop_engine_subtree(self, node: Node, engine: EngineId) -> int:
        freed = 0
        stack = [node]
        lru = self._lru[engine]
        while stack:
            n = stack.pop()
            held = n.engines.pop(engine, 0)
            if not held:
                continue
            lru.pop(n, None)
            freed += held
            if not n.engines:
                self._orphans.append(n)
            stack.extend(n.children.values())
            if not n.children:
                self._refresh_leaf(n)
        self._cached[engine] -= freed
        return freed

    def _refresh_leaf(self, node: Node) -> None:
        if node is self.root:
            return
        self._leaves_cold.pop(node, None)
        self._leaves_warm.pop(node, None)
        if node.children or node.parent is None:
            return
        leaves = self._leaves_warm if node.engines else self._leaves_cold
        oldest = next(iter(leaves), None)
        leaves[node] = None
        if oldest is not None and node.last_access < oldest.last_access:
            # A parent left childless by an eviction can be older than every leaf: it goes
            # first, not last (leaves are otherwise refreshed as they are used, newest last).
            leaves.move_to_end(node, last=False)

    def _maybe_drop(self, node: Node, horizon: float) -> None:
        while (
            node is not self.root
            and node.parent is not None
            and not node.children
            and not node.engines
            and node.last_access < horizon
            and not any(_count_since(t, horizon) for t in node.hits.values())
        ):
            parent = node.parent
            self._remove_leaf(node)
            node = parent

    def _remove_leaf(self, node: Node) -> None:
        parent = node.parent
        assert parent is not None and not node.children
        del parent.children[node.blocks[0]]
        node.parent = None
        for h in node.blocks:
            if self._index.get(h) is node:
                del self._index[h]
        for engine, held in node.engines.items():
            self._lru[engine].pop(node, None)
            self._cached[engine] -= held
        node.engines = {}
        # The expiry queue holds weak references only: a removed node is freed at once, so
        # memory follows the tree's bound rather than the request rate.
        self._leaves_cold.pop(node, None)
        self._leaves_warm.pop(node, None)
        self._num_nodes -= 1
        if not parent.children:
            self._refresh_leaf(parent)

    def _enforce_bound(self, protect: Sequence[Node]) -> None:
        keep = set(map(id, protect))
        for leaves in (self._leaves_cold, self._leaves_warm):
            skipped = 0
            while len(self._index) > self.max_blocks and len(leaves) > skipped:
                node = next(iter(leaves))
                if id(node) in keep:
                    leaves.move_to_end(node)
                    skipped += 1
                    continue
                parent = node.parent
                self._remove_leaf(node)
                skipped = 0
                if parent is not None and parent is not self.root and not parent.children:
                    self._refresh_leaf(parent)


def _common(blocks: list[int], hashes: Sequence[int], start: int) -> int:
    """Length of the common prefix of ``blocks`` and ``hashes[start:]``."""
    n = min(len(blocks), len(hashes) - start)
    if blocks[:n] == list(hashes[start : start + n]):
        return n
    # Chained hashes agree on a prefix and then differ everywhere: binary search the
    # boundary, then verify (arbitrary, unchained input falls back to a linear scan).
    lo, hi = 0, n  # blocks[:lo] match, blocks[hi - 1] does not
    while lo < hi:
        mid = (lo + hi) // 2
        if blocks[mid] == hashes[start + mid]:
            lo = mid + 1
        else:
            hi = mid
    if blocks[:lo] == list(hashes[start : start + lo]):
        return lo
    k = 0
    while k < n and blocks[k] == hashes[start + k]:
        k += 1
    return k

"""The emulator's KV cache events, published as vLLM publishes them (ZMQ, msgpack).

``kvgate emulate --kv-events-config JSON`` takes vLLM's ``KVEventsConfig`` fields
(``enable_kv_cache_events``, ``publisher`` "zmq", ``endpoint``, ``replay_endpoint``,
``buffer_steps``, ``hwm``, ``topic``). Each engine step that stored or evicted prefix
blocks publishes one batch on a PUB socket as the 3-frame multipart
``[topic, seq (8-byte big-endian), payload]``, ``payload`` the msgpack of
``[ts, [event, ...], dp_rank]`` with vLLM 0.30+'s tagged-map events
``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids``,
``block_size``, ``medium`` "GPU"...), ``BlockRemoved`` (one hash each) and
``AllBlocksCleared`` (``POST /reset_prefix_cache`` with no block in use). A ROUTER
replay socket answers ``[b"", start_seq]`` with the buffered batches from
``start_seq`` on (``[b"", topic, seq, payload]``), then ``[b"", b"", -1, b""]``.
``GET /kv_event_sources`` reports the bound endpoints per DP rank (rank 0 only), as
vLLM's API server does, so the gateway's event bridge finds them.

Block ids are vLLM's: the chained ``sha256`` (or ``sha256_cbor``) of the prompt's
full blocks of token ids, seeded as vLLM seeds them (``PYTHONHASHSEED`` or
``"vllm-none-hash"``), low 64 bits (:mod:`gateway.core.vllm_hash`); the engine keeps
its own block hashes inside, and this module maps them. Differences from vLLM:
every ``tcp://`` endpoint is bound (vLLM connects to a non-wildcard host), blocks of
generated tokens are not cached (so never announced), one ``BlockStored`` per
request and step. A LoRA request's blocks carry ``("lora", name, path)`` in their
hash and ``lora_name`` / ``lora_id`` / ``extra_keys`` (``(name,)`` per block) in the
event; a ``cache_salt`` enters the first block's hash and extra keys, as in vLLM 0.32.

Memory: the id map holds one entry per block the engine caches or an in-flight
request will compute (bounded by its KV pool plus in-flight prompts), token ids only
for blocks not yet stored; the replay buffer keeps ``buffer_steps`` batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from gateway.core.errors import ConfigError
from gateway.core.vllm_hash import ALGORITHMS, LoraKey, block_ids, event_extra_keys
from gateway.perfmodel.kvcache import BlockPool

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _Stored(msgspec.Struct, tag="BlockStored", omit_defaults=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[str, ...] | None] | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved", omit_defaults=True):
    block_hashes: list[int]
    medium: str | None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True):
    pass


_ENCODER = msgspec.msgpack.Encoder()


@dataclass(frozen=True, slots=True)
class _BlockInfo:
    """One block's event fields: parent id, token ids, adapter, untagged extra keys."""

    parent: int | None
    tokens: tuple[int, ...]
    lora_name: str | None = None
    lora_id: int | None = None
    extra: tuple[str, ...] | None = None


_NO_BLOCK = _BlockInfo(None, ())


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` fields the emulator honours."""

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""
    hash_algo: str = "sha256"
    """``--prefix-caching-hash-algo`` (``sha256`` or ``sha256_cbor``)."""
    hash_seed: str | None = None
    """The engine's ``PYTHONHASHSEED`` (None: vLLM's fixed default seed)."""

    @classmethod
    def parse(
        cls, raw: str, *, hash_algo: str = "sha256", hash_seed: str | None = None
    ) -> KVEventsConfig | None:
        """The config of a ``--kv-events-config`` JSON; None when events stay off."""
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise ConfigError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError("--kv-events-config must be a JSON object")
        known = {
            "enable_kv_cache_events",
            "publisher",
            "endpoint",
            "replay_endpoint",
            "buffer_steps",
            "hwm",
            "max_queue_size",
            "topic",
        }
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"--kv-events-config: unknown field(s) {', '.join(unknown)}")
        if not data.get("enable_kv_cache_events"):
            return None
        if (data.get("publisher") or "zmq") != "zmq":
            return None  # vLLM's "null" publisher
        config = cls(
            endpoint=str(data.get("endpoint") or "tcp://*:5557"),
            replay_endpoint=data.get("replay_endpoint"),
            buffer_steps=int(data.get("buffer_steps", 10_000)),
            hwm=int(data.get("hwm", 100_000)),
            topic=str(data.get("topic") or ""),
            hash_algo=hash_algo,
            hash_seed=hash_seed,
        )
        config.check()
        return config

    def check(self) -> None:
        if self.hash_algo not in ALGORITHMS:
            raise ConfigError(
                f"prefix caching hash algorithm must be one of {', '.join(ALGORITHMS)} "
                f"with KV events, got {self.hash_algo!r}"
            )
        for name, value in (("endpoint", self.endpoint), ("replay_endpoint", self.replay_endpoint)):
            if value is not None and not value.startswith(("tcp://", "ipc://")):
                raise ConfigError(f"KV events {name} must be tcp:// or ipc://, got {value!r}")
        if self.buffer_steps < 1 or self.hwm < 1:
            raise ConfigError("KV events buffer_steps and hwm must be positive")


def _bind(sock: zmq.Socket[Any], endpoint: str) -> str:
    """Bind ``endpoint`` (port 0: a free one); the endpoint as bound, wildcard kept."""
    if "://[" in endpoint or "::" in endpoint:
        sock.setsockopt(zmq.IPV6, 1)
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme == "tcp" and port == "0":
        bound = sock.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{bound}"
    sock.bind(endpoint)
    return endpoint


class KVEventPublisher:
    """One DP rank's publisher. Driver hooks: ``on_submit``, ``on_step``, ``on_done``."""

    def __init__(self, config: KVEventsConfig, block_size: int, *, rank: int = 0) -> None:
        self.config = config
        self.block_size = block_size
        self.rank = rank
        self.topic = config.topic.encode()
        self.seq = 0
        self.endpoint = config.endpoint
        self.replay_endpoint = config.replay_endpoint
        self._ids: dict[int, int] = {}
        """Engine block hash -> vLLM block id: blocks cached, or of an in-flight request."""
        self._blocks: dict[int, _BlockInfo] = {}
        """Engine block hash -> what its event says, while an in-flight request has it."""
        self._refs: dict[int, int] = {}
        self._cached: set[int] = set()
        """Engine block hashes announced stored and not removed since."""
        self._users: dict[str, tuple[int, ...]] = {}
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._sync_ctx: zmq.Context[Any] | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.Socket[Any] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._serving: asyncio.Task[None] | None = None

    @property
    def batches(self) -> int:
        """Batches published so far."""
        return self.seq

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        """Bind the sockets (on the running loop: the replay server is a task)."""
        self._sync_ctx = zmq.Context()
        self._ctx = zmq.asyncio.Context()
        try:
            pub = self._pub = self._sync_ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            self.endpoint = _bind(pub, self.config.endpoint)
            if self.config.replay_endpoint is not None:
                self._router = self._ctx.socket(zmq.ROUTER)
                self.replay_endpoint = _bind(self._router, self.config.replay_endpoint)
                self._serving = asyncio.create_task(self._serve(), name="kv-events-replay")
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ConfigError(f"cannot bind KV events socket: {exc}") from None
        log.info(
            "publishing KV events",
            extra={"endpoint": self.endpoint, "replay": self.replay_endpoint},
        )

    async def close(self) -> None:
        if self._serving is not None:
            self._serving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._serving
            self._serving = None
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
        for ctx in (self._ctx, self._sync_ctx):
            if ctx is not None:
                ctx.destroy(linger=0)
        self._ctx = self._sync_ctx = None

    def sources(self) -> dict[str, dict[str, Any]]:
        """``GET /kv_event_sources``: the resolved config of each DP rank."""
        return {
            str(self.rank): {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": self.endpoint,
                "replay_endpoint": self.replay_endpoint,
                "buffer_steps": self.config.buffer_steps,
                "hwm": self.config.hwm,
                "max_queue_size": self.config.buffer_steps,
                "topic": self.config.topic,
            }
        }

    # -- driver hooks ------------------------------------------------------------
    def on_submit(
        self,
        request_id: str,
        token_ids: Sequence[int],
        hashes: Sequence[int],
        *,
        lora: LoraKey | None = None,
        cache_salt: str | None = None,
        lora_id: int | None = None,
    ) -> None:
        """Map a new request's blocks (the engine's ``hashes``) to vLLM ids and tokens;
        ``lora`` / ``cache_salt`` enter the ids and the events as vLLM 0.32 puts them."""
        cfg = self.config
        bs = self.block_size
        ids = block_ids(
            token_ids, bs, algo=cfg.hash_algo, seed=cfg.hash_seed, lora=lora, cache_salt=cache_salt
        )
        extras = event_extra_keys(len(ids), lora=lora, cache_salt=cache_salt)
        name = lora.name if lora is not None else None
        for k, (h, vid) in enumerate(zip(hashes, ids, strict=True)):
            self._refs[h] = self._refs.get(h, 0) + 1
            self._ids.setdefault(h, vid)
            if h not in self._blocks:
                self._blocks[h] = _BlockInfo(
                    ids[k - 1] if k else None,
                    tuple(token_ids[k * bs : (k + 1) * bs]),
                    name,
                    lora_id if name is not None else None,
                    extras[k] if extras is not None else None,
                )
        self._users[request_id] = tuple(hashes)

    def on_done(self, request_id: str) -> None:
        """A request left the engine: forget the blocks only it knew and the engine lacks."""
        for h in self._users.pop(request_id, ()):
            n = self._refs.get(h, 0) - 1
            if n > 0:
                self._refs[h] = n
                continue
            self._refs.pop(h, None)
            self._blocks.pop(h, None)
            if h not in self._cached:
                self._ids.pop(h, None)

    def on_step(self, stored: Sequence[int], removed: Sequence[int]) -> None:
        """Publish what one engine step changed (evictions first: they happened first)."""
        if not stored and not removed:
            return
        events: list[Any] = []
        for h in removed:
            vid = self._forget(h)
            if vid is not None:
                events.append(_Removed([vid], "GPU"))
        run: list[int] = []
        run_tokens: list[int] = []
        run_extras: list[tuple[str, ...] | None] = []
        head = _NO_BLOCK
        for h in stored:
            vid = self._ids.get(h)
            if vid is None:  # pragma: no cover - a block no request announced
                continue
            self._cached.add(h)
            info = self._blocks.get(h, _NO_BLOCK)
            if run and (info.parent != run[-1] or info.lora_name != head.lora_name):
                events.append(self._stored(run, head, run_tokens, run_extras))
                run, run_tokens, run_extras = [], [], []
            if not run:
                head = info
            run.append(vid)
            run_tokens.extend(info.tokens)
            run_extras.append(info.extra)
        if run:
            events.append(self._stored(run, head, run_tokens, run_extras))
        if events:
            self._publish(events)

    def cleared(self, dropped: Sequence[int], anything_held: bool) -> None:
        """The prefix cache was reset and ``dropped`` blocks are gone. With no block held by
        a running request the cache is empty (``AllBlocksCleared``); otherwise the dropped
        blocks are announced one by one, as evictions."""
        if anything_held:
            self.on_step((), dropped)
            return
        for h in dropped:
            self._forget(h)
        self._publish([_Cleared()])

    def _forget(self, h: int) -> int | None:
        """``h`` left the cache: its vLLM id when it had been announced."""
        if h not in self._cached:
            return None
        self._cached.discard(h)
        return self._ids.get(h) if h in self._refs else self._ids.pop(h, None)

    def _stored(
        self,
        ids: list[int],
        head: _BlockInfo,
        tokens: list[int],
        extras: list[tuple[str, ...] | None],
    ) -> _Stored:
        keys = extras if any(e is not None for e in extras) else None
        return _Stored(
            ids, head.parent, tokens, self.block_size, head.lora_id, "GPU", head.lora_name, keys
        )

    def _publish(self, events: list[Any]) -> None:
        payload = _ENCODER.encode(_Batch(time.time(), events, self.rank))
        seq = self.seq
        self.seq += 1
        self._buffer.append((seq, payload))
        if self._pub is not None:
            with contextlib.suppress(zmq.Again):  # past the HWM PUB drops, as vLLM's does
                self._pub.send_multipart(
                    [self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK
                )

    # -- replay ------------------------------------------------------------------
    async def _serve(self) -> None:
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            if len(frames) < 2 or len(frames[-1]) != 8:
                continue  # not a replay request
            client, start = frames[0], int.from_bytes(frames[-1], "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await router.send_multipart(
                        [client, b"", self.topic, seq.to_bytes(8, "big"), payload]
                    )
            await router.send_multipart([client, b"", b"", END_SEQ, b""])


def reset_prefix_cache(pool: BlockPool, publisher: KVEventPublisher | None) -> int:
    """``POST /reset_prefix_cache``: drop every cached block no request holds; the number
    dropped. The publisher announces it (not the next step, which would repeat it)."""
    before = len(pool.removed)
    dropped = pool.clear()
    del pool.removed[before:]
    if publisher is not None:
        publisher.cleared(dropped, anything_held=pool.cached > 0)
    return len(dropped)

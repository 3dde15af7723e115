"""EngineCore: one vLLM engine's scheduler, stepped by a driver in virtual or real time.

It follows vLLM's V1 scheduler: each step has a token budget
(``max_num_batched_tokens``); running requests are served first (a decode
takes one token, a prefill takes a chunk of what is left), then waiting
requests are admitted while budget, sequence slots and KV blocks last. A new
request reuses the longest cached prefix of whole blocks (at least one prompt
token is always recomputed). When KV runs out, the most recently admitted
running request is preempted (its blocks freed, recomputed later).

Drivers call :meth:`start_step` to plan a step (it returns the step's end
time), then :meth:`finish_step` at that time to apply it. When every
scheduled request is decoding and nothing can be admitted, one call may plan
a *decode run* of several identical steps (up to ``horizon``), which the
simulator uses to skip events; :meth:`interrupt` cuts a run short when a new
request arrives mid-run. The emulator sets ``max_decode_run=1``. LoRA adapters follow
vLLM's slot rule and pay their load time inside the step (``perfmodel/lora.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gateway.perfmodel.kvcache import BlockPool
from gateway.perfmodel.lora import AdapterCache, LoraInfo, SlotGate, batch_adapters
from gateway.perfmodel.model import PerfModel
from gateway.perfmodel.queues import FcfsQueue, PrefixCounts, PriorityGroupQueue, WaitQueue
from gateway.perfmodel.request import EngineRequest, StepOutcome

__all__ = ["EngineCore", "EngineRequest", "StepOutcome"]  # the records live in request.py


@dataclass(slots=True)
class _Plan:
    start: float
    end: float
    items: list[tuple[EngineRequest, int]]
    steps: int
    decode_only: bool
    batch: int = 0
    ctx: int = 0
    preempted: list[EngineRequest] = field(default_factory=list)


class EngineCore:
    """A simulated vLLM engine: continuous batching over a shared KV block pool."""

    def __init__(
        self,
        engine_id: str,
        model: PerfModel,
        *,
        priority_groups: bool = False,
        track_cache_events: bool = False,
        max_decode_run: int = 256,
    ) -> None:
        self.id = engine_id
        self.model = model
        self.pool = BlockPool(model.kv_capacity_blocks, track_events=track_cache_events)
        self.waiting: WaitQueue = PriorityGroupQueue() if priority_groups else FcfsQueue()
        self._rotating = priority_groups
        self.running: list[EngineRequest] = []
        self.max_decode_run = max(1, max_decode_run)
        self.steps = 0
        self.preemptions = 0
        self._plan: _Plan | None = None
        self._waiting_pending = 0
        self._running_pending = 0
        self._pending_prefix = PrefixCounts()
        """Prompt blocks of the requests queued or still prefilling, with a count each: a
        request queued behind another with the same prefix will hit it, so its pending
        prefill leaves that prefix out (at most the queued requests' blocks)."""
        self._by_id: dict[str, EngineRequest] = {}
        self._last_end = -math.inf
        """End of the last step: an engine idle since long enough wakes slowly."""
        self.adapters = AdapterCache(
            model.max_loras, model.max_cpu_loras, model.lora_load_s, model.lora_activate_s
        )

    # -- state ---------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """A step is planned and not yet finished."""
        return self._plan is not None

    @property
    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def pending_prefill_tokens(self) -> int:
        """Uncached prompt tokens queued or still being prefilled; a prefix that a request
        ahead in the queue will have computed counts once."""
        return self._waiting_pending + self._running_pending

    @property
    def pending_prefix_blocks(self) -> int:
        """Distinct prompt blocks of the queued and prefilling requests (the set above)."""
        return len(self._pending_prefix)

    @property
    def lora_info(self) -> LoraInfo:
        """Adapters running and waiting, and ``--max-loras`` (``vllm:lora_requests_info``)."""
        return LoraInfo.of(self.running, self.waiting, self.model.max_loras)

    @property
    def kv_usage(self) -> float:
        return self.pool.usage

    @property
    def step_end(self) -> float | None:
        return None if self._plan is None else self._plan.end

    def admissible(self, prompt_tokens: int, output_tokens: int) -> str | None:
        """Why a request can never run here, or ``None`` when it can."""
        total = prompt_tokens + output_tokens
        if prompt_tokens <= 0 or output_tokens <= 0:
            return "prompt and output must each have at least one token"
        if total > self.model.max_model_len:
            return f"{total} tokens exceed max_model_len {self.model.max_model_len}"
        if self.model.blocks_for(total) > self.pool.capacity:
            return f"{total} tokens exceed the KV capacity of {self.pool.capacity} blocks"
        return None

    # -- requests --------------------------------------------------------------
    def submit(self, req: EngineRequest) -> None:
        """Queue a request; it is admitted at the next step boundary."""
        reason = self.admissible(req.prompt_tokens, req.output_tokens)
        if reason is not None:
            raise ValueError(f"request {req.id}: {reason}")
        if req.id in self._by_id:
            raise ValueError(f"request {req.id} is already in engine {self.id}")
        bs = self.model.block_size
        limit = min(len(req.block_hashes), (req.prompt_tokens - 1) // bs)
        ahead = self.pool.match(req.block_hashes, limit, also=self._pending_prefix)
        hit = max(ahead, self._remote_blocks(req, limit))
        req.hit_ratio = hit * bs / req.prompt_tokens
        req.est_uncached = req.prompt_tokens - hit * bs
        self._waiting_pending += req.est_uncached
        self._add_pending_prefix(req, limit)
        self._by_id[req.id] = req
        self.waiting.push(req)

    def abort(self, request_id: str) -> bool:
        """Drop a request (client gone). Mid-step requests leave at the step's end."""
        req = self._by_id.get(request_id)
        if req is None:
            return False
        req.aborted = True
        if self.waiting.remove(req):
            self._waiting_pending -= req.est_uncached
            self._drop_pending_prefix(req)
            del self._by_id[req.id]
            return True
        if self._plan is None and req in self.running:
            self._drop_running(req)
        return True

    # -- stepping ------------------------------------------------------------
    def start_step(self, now: float, horizon: float = float("inf")) -> float | None:
        """Plan the next step at ``now``; returns its end time, or None when idle."""
        if self._plan is not None:
            raise RuntimeError(f"engine {self.id}: step already planned")
        plan = self._schedule(now)
        if plan is None:
            return None
        wake = self.model.wake_delay(now - self._last_end)
        if wake:
            plan.start += wake
            plan.end += wake
        if plan.decode_only and self.max_decode_run > 1:
            self._extend_decode_run(plan, horizon)
        self._plan = plan
        return plan.end

    def interrupt(self, now: float) -> float | None:
        """Cut a decode run at the first step boundary at or after ``now``."""
        plan = self._plan
        if plan is None or plan.steps <= 1 or now >= plan.end:
            return None if plan is None else plan.end
        model = self.model
        k = model.decode_steps_within(plan.batch, plan.ctx, now - plan.start)
        if model.decode_run_time(plan.batch, plan.ctx, k) < now - plan.start - 1e-12:
            k += 1
        k = min(max(k, 1), plan.steps)
        if k < plan.steps:
            extra = sum(
                model.blocks_for(r.num_computed + plan.steps) - model.blocks_for(r.num_computed + k)
                for r, _ in plan.items
            )
            self._shrink_run(plan, k, extra)
        return plan.end

    def finish_step(self) -> StepOutcome:
        """Apply the planned step: tokens computed, first tokens, completions."""
        plan = self._plan
        if plan is None:
            raise RuntimeError(f"engine {self.id}: no step planned")
        self._plan = None
        self.steps += plan.steps
        if plan.steps > 1:
            self.waiting.skip_steps(plan.steps - 1)
        self._last_end = plan.end
        out = StepOutcome(start=plan.start, end=plan.end, steps=plan.steps)
        out.preempted = plan.preempted
        bs = self.model.block_size
        pool = self.pool
        for req, n in plan.items:
            if req.aborted:
                continue
            if plan.steps > 1:
                req.num_computed += plan.steps
                req.num_output += plan.steps
                out.decode_tokens += plan.steps
                out.tokens.append((req, plan.steps))
            else:
                if req.decoding:
                    out.decode_tokens += 1
                else:
                    out.prefill_tokens += n
                done = min(n, req.prefill_pending)
                req.prefill_pending -= done
                self._running_pending -= done
                if not req.prefill_pending and req.pending_blocks:
                    self._drop_pending_prefix(req)  # its blocks are in the prefix cache now
                req.num_computed += n
                # register newly completed prompt blocks in the prefix cache
                limit = min(len(req.block_hashes), req.num_computed // bs)
                if req.next_block < limit:
                    hashes = req.block_hashes[req.next_block : limit]
                    req.anon -= pool.register_many(hashes, req.held)
                    req.next_block = limit
                if req.num_computed >= req.total_tokens:
                    if req.num_output == 0:
                        req.first_token_time = plan.end
                        out.first_tokens.append(req)
                    req.num_output += 1
                    out.tokens.append((req, 1))
            if req.num_output >= req.output_tokens:
                req.finish_time = plan.end
                out.finished.append(req)
        delay = self.model.frontend_delay(len(out.tokens))
        if delay:
            for req in out.first_tokens:
                req.client_delay_first = delay
            for req in out.finished:
                req.client_delay_last = delay
        for req in out.finished:
            self._drop_running(req)
        for req in [r for r in self.running if r.aborted]:
            self._drop_running(req)
            out.aborted.append(req)
        if pool.track_events:
            out.stored, out.removed = pool.drain_events()
        return out

    # -- internals -------------------------------------------------------------
    def _schedule(self, now: float) -> _Plan | None:
        model = self.model
        bs = model.block_size
        pool = self.pool
        budget = model.max_num_batched_tokens
        items: list[tuple[EngineRequest, int]] = []
        preempted: list[EngineRequest] = []
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(req.total_tokens - req.num_computed, budget)
            need = model.blocks_for(req.num_computed + n) - req.num_blocks
            victim: EngineRequest | None = None
            while need > pool.available:
                victim = running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if victim is req:
                break
            pool.allocate(need)
            req.anon += need
            items.append((req, n))
            budget -= n
            i += 1
        admission_blocked = False
        skipped: list[EngineRequest] = []
        if not preempted:
            waiting = self.waiting
            waiting.begin_step()
            gate = SlotGate(running, model.max_loras)
            while budget > 0:
                cand = waiting.peek()
                if cand is None:
                    admission_blocked = bool(skipped)  # all the rest wait for a LoRA slot
                    break
                if len(running) >= model.max_num_seqs:
                    admission_blocked = True
                    break
                req = cand
                if gate.blocks(req):  # its adapter waits for a slot; the next may go
                    skipped.append(waiting.take())
                    continue
                limit = min(len(req.block_hashes), (req.total_tokens - 1) // bs)
                hits = pool.match(req.block_hashes, limit)
                remote = self._remote_blocks(req, limit) if req.cached_tokens is None else 0
                ready = max(hits, remote)  # blocks present at admission: cached or loaded
                hit_hashes = req.block_hashes[:hits]
                computed = ready * bs
                n = min(req.total_tokens - computed, budget)
                need = model.blocks_for(computed + n) - hits
                if need > pool.available - pool.count_evictable(hit_hashes):
                    admission_blocked = True
                    break
                waiting.take()
                pool.acquire(hit_hashes)
                pool.allocate(need)
                req.held = list(hit_hashes)
                req.anon = need
                if ready > hits:  # KV loaded from the prefill engine joins the prefix cache
                    req.anon -= pool.register_many(req.block_hashes[hits:ready], req.held)
                req.next_block = ready
                req.num_computed = computed
                if req.cached_tokens is None:
                    req.cached_tokens = hits * bs
                    req.external_tokens = (ready - hits) * bs
                    req.first_scheduled = now
                self._waiting_pending -= req.est_uncached
                req.prefill_pending = req.prefill_left
                self._running_pending += req.prefill_pending
                running.append(req)
                items.append((req, n))
                budget -= n
            for req in reversed(skipped):
                waiting.push_front(req)
        if not items:
            if preempted:
                # Everything runnable was preempted; try again with the freed blocks.
                return _Plan(now, now, [], 1, False, preempted=preempted)
            return None
        chunks: list[tuple[int, int]] = []
        batch = ctx = 0
        for req, n in items:
            if req.decoding:
                batch += 1
                ctx += req.num_computed
            else:
                chunks.append((n, req.num_computed))
        end = now + model.step_time(chunks, batch, ctx)
        load = self.adapters.activate(batch_adapters(r for r, _ in items))
        end += load
        # A run skips admission attempts; that is exact only while the same head-of-line
        # request stays blocked (FCFS). Priority groups rotate the head every step.
        blocked = admission_blocked and not self._rotating
        decode_only = (
            not chunks and not preempted and not load and (len(self.waiting) == 0 or blocked)
        )
        return _Plan(now, end, items, 1, decode_only, batch, ctx, preempted)

    def _extend_decode_run(self, plan: _Plan, horizon: float) -> None:
        model = self.model
        k = min(self.max_decode_run, *(r.output_tokens - r.num_output for r, _ in plan.items))
        if horizon != float("inf"):
            k = min(
                k, max(1, model.decode_steps_within(plan.batch, plan.ctx, horizon - plan.start))
            )
        if k <= 1:
            return
        # Only never-used blocks: a run must not evict cached prefixes that single steps
        # would still hold when an interrupt cuts the run short.
        avail = self.pool.free

        def extra(steps: int) -> int:
            return sum(
                model.blocks_for(r.num_computed + steps) - model.blocks_for(r.num_computed + 1)
                for r, _ in plan.items
            )

        while k > 1 and extra(k) > avail:
            k //= 2
        if k <= 1:
            return
        need = extra(k)
        self.pool.allocate(need)
        for r, _ in plan.items:
            r.anon += model.blocks_for(r.num_computed + k) - model.blocks_for(r.num_computed + 1)
        plan.steps = k
        plan.end = plan.start + model.decode_run_time(plan.batch, plan.ctx, k)

    def _shrink_run(self, plan: _Plan, k: int, extra: int) -> None:
        model = self.model
        for r, _ in plan.items:
            r.anon -= model.blocks_for(r.num_computed + plan.steps) - model.blocks_for(
                r.num_computed + k
            )
        self.pool.release((), extra)
        plan.steps = k
        plan.end = plan.start + model.decode_run_time(plan.batch, plan.ctx, k)

    def _remote_blocks(self, req: EngineRequest, limit: int) -> int:
        """Full prompt blocks whose KV arrives from a prefill engine (vLLM loads whole blocks
        and recomputes the rest, at least one token)."""
        if req.remote_tokens <= 0:
            return 0
        return min(limit, min(req.remote_tokens, req.prompt_tokens - 1) // self.model.block_size)

    def _add_pending_prefix(self, req: EngineRequest, limit: int) -> None:
        self._pending_prefix.add(req.block_hashes[:limit])
        req.pending_blocks = limit

    def _drop_pending_prefix(self, req: EngineRequest) -> None:
        self._pending_prefix.drop(req.block_hashes[: req.pending_blocks])
        req.pending_blocks = 0

    def _preempt(self, req: EngineRequest) -> None:
        self.running.remove(req)
        self._running_pending -= req.prefill_pending
        req.prefill_pending = 0
        self.pool.release(req.held, req.anon)
        req.held = []
        req.anon = 0
        req.next_block = 0
        req.num_computed = 0
        req.preemptions += 1
        self.preemptions += 1
        req.est_uncached = req.total_tokens
        self._waiting_pending += req.est_uncached
        self.waiting.push_front(req)

    def _drop_running(self, req: EngineRequest) -> None:
        self.running.remove(req)
        self._drop_pending_prefix(req)
        self._running_pending -= req.prefill_pending
        req.prefill_pending = 0
        self.pool.release(req.held, req.anon)
        req.held = []
        req.anon = 0
        self._by_id.pop(req.id, None)

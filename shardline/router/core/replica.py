"""The router's connection to its shard group, kept up for the router's whole life.

- connect: every shard's Info, checked to form one replica of the model the router serves, with
  its page size, dtype and a vocabulary that holds every token id its tokenizer makes; Warmup with
  the pool size (the smallest shard capacity, or `--num-pages`); a new engine over a fresh page
  pool and prefix index (what an old one described is gone). Then SERVING.
- serve: the engine runs steps until the group fails (a step stream breaks, a step errs, or a
  long step meets a shard that does not answer) or the loop itself raises.
- fail: every request in flight or waiting ends UNAVAILABLE (INTERNAL if the router's own loop
  failed), the pool and prefix index are dropped (the KV they describe is gone or unknown),
  health turns NOT_SERVING, and connect is retried with backoff until the group is back (a
  multi-rank one as a new start of it: ShardGroup.info).
- stop: new requests are refused (UNAVAILABLE) while the ones already accepted run to completion
  for up to `drain_timeout_s`; what is left then ends UNAVAILABLE, and the step streams are
  closed cleanly so the shards keep their state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from shardline.common.tokenizer import TextCodec
from shardline.router.core.config import ReplicaConfig
from shardline.router.core.engine import Engine, Load
from shardline.router.core.events import RequestEvents
from shardline.router.core.kv_manager import KVManager
from shardline.router.core.kv_pools import pool_sizes, window_span
from shardline.router.core.page_manager import PageManager
from shardline.router.core.scheduler import Scheduler
from shardline.router.core.sequence import Failure, Sequence
from shardline.router.core.shards import ShardError, ShardInfo, Shards, Warmup
from shardline.router.core.speculation import Speculator

log = logging.getLogger("shardline.router")
BACKOFF_S = (0.5, 1, 2, 4, 5)


@dataclass(frozen=True)
class Served:
    """What the replica serves once its shard group is connected: the shards' Info and Warmup
    answers, and what the router made of them."""

    infos: list[ShardInfo]
    warmups: list[Warmup]
    head: ShardInfo  # the sampling shard's: the model as served
    num_pages: int
    layer_groups: int  # as the scheduler runs them: 1 where they do not apply
    eos_ids: frozenset[int]  # the shards' and the tokenizer's

    @property
    def pool_tokens(self) -> int:
        return self.num_pages * self.head.page_size


class Replica:
    def __init__(
        self,
        config: ReplicaConfig,
        model_name: str,
        shards: Shards,
        codec: TextCodec,
        on_serving: Callable[[bool], Awaitable[None]],
        observers: list[RequestEvents] = (),
    ):
        self.config, self.model_name, self.shards, self.codec = config, model_name, shards, codec
        self.observers = list(observers)
        self.on_serving = on_serving
        self.engine: Engine | None = None  # one per connection of the shard group
        self.served: Served | None = None
        self.serving = False
        self.accepting = True  # false once a drain began
        self.down_reason = "connecting to the shards"
        self.failures = 0
        self.recoveries = 0

    # -- what the request path and the observers ask --------------------------------------------
    def submit(self, seq: Sequence, stops: list[str]) -> None:
        self.engine.submit(seq, stops)

    def cancel(self, seq: Sequence) -> None:
        """Cancels at the next step boundary (nothing to do for a sequence a failure ended)."""
        self.engine.cancel(seq)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.engine.can_ever_fit(num_tokens)

    def waiting(self, tenant: str | None = None) -> int:
        return self.engine.waiting(tenant)

    def load(self) -> Load | None:
        """The queues now; None before the shard group was first connected."""
        return self.engine.load() if self.engine is not None else None

    @property
    def pool(self) -> PageManager | None:
        """The page pool and prefix index of the current connection (None before the first)."""
        return self.engine.pool if self.engine is not None else None

    @property
    def window_pool(self) -> PageManager | None:
        """The sliding-window layers' own pool of the current connection, where there is one."""
        return self.engine.scheduler.kv.window_pool if self.engine is not None else None

    # -- connect ------------------------------------------------------------------------------
    async def _connect(self) -> None:
        config = self.config
        infos = await self.shards.info(timeout=config.shard_timeout_s)
        head = infos[self.shards.sampler]
        wrong = [
            f"{what} {theirs!r} (the router's is {ours!r})"
            for what, theirs, ours in (
                ("model", head.model, self.model_name),
                ("page size", head.page_size, config.page_size),
                ("dtype", head.dtype, config.dtype),
            )
            if theirs != ours
        ]
        if self.codec.vocab_size > head.vocab_size:
            wrong.append(f"vocabulary of {head.vocab_size} tokens (the router's tokenizer has {self.codec.vocab_size})")
        if wrong:
            raise ShardError("the shards serve a different model: " + "; ".join(wrong))
        # A window pool frees what the window leaves behind as a prompt's chunks are computed:
        # with whole prompts (--chunk-size 0) a windowed model's are cut at the window.
        window_chunk = config.chunk_size or head.window
        step_tokens = max(window_chunk, config.spec_tokens + 2)  # a verification's, or a step's sent ahead
        span = window_span(head.window, step_tokens, head.page_size) if head.window else 0
        context_pages = -(-head.context_length // head.page_size)
        sizes = pool_sizes(infos, config.max_batch, span, config.num_pages, context_pages)
        num_pages = sizes.pages
        if num_pages < 1 or sizes.window_pages and sizes.window_pages < span:
            raise ShardError(f"the shards have room for {num_pages} pages ({sizes}); raise --kv-memory-gb")
        chunk_size = window_chunk if sizes.window_pages else config.chunk_size
        warmups = await self.shards.warmup(num_pages, config.max_batch, sizes.window_pages)
        buckets = {tuple(w.decode_graph_buckets) for w in warmups}
        if len(buckets) > 1:  # every shard opened its step stream: the next attempt must find them closed
            await self.shards.close_streams(abandon=False)
            raise ShardError(f"the shards captured different decode graph buckets: {sorted(buckets)}")
        eos = set(head.eos_token_ids) | self.codec.end_token_ids
        pool = PageManager(
            num_pages,
            head.page_size,
            policy=config.eviction,
            prefix_cache=config.prefix_cache,
            protected_ratio=config.slru_protected_ratio,
            model_key=f"{head.model}/{head.dtype}",
        )
        window_pool = None
        if sizes.window_pages:
            window_pool = PageManager(
                sizes.window_pages,
                head.page_size,
                policy=config.eviction,
                prefix_cache=config.prefix_cache,
                protected_ratio=config.slru_protected_ratio,
                model_key=pool.model_key,
            )
        scheduler = Scheduler(
            KVManager(pool, window_pool, head.window, span),
            config.max_batch,
            config.max_batch_tokens,
            chunk_size=chunk_size,
            aging_s=config.priority_aging_s,
            mixed_steps=config.mixed_steps,
            pair_cost=head.attention_pair_cost,
            num_layers=head.num_layers,
            layer_groups=config.layer_groups,
            stages=head.pp_size,
            speculator=Speculator(config.speculative, config.spec_tokens, head.context_length),
        )
        self.served = Served(list(infos), list(warmups), head, num_pages, scheduler.layer_groups, frozenset(eos))
        self.engine = Engine(scheduler, self.shards, self.codec, head.context_length, self.observers)
        log.info(
            "serving %s: TP%d x PP%d, %d pages of %d tokens%s",
            head.model,
            head.tp_size,
            head.pp_size,
            num_pages,
            head.page_size,
            f", {sizes.window_pages} window pages" if sizes.window_pages else "",
        )

    # -- the replica's life ---------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        attempt = 0
        while not stop.is_set():
            connect, stopped = asyncio.ensure_future(self._connect()), asyncio.ensure_future(stop.wait())
            await asyncio.wait([connect, stopped], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if stop.is_set():
                connect.cancel()
                await asyncio.gather(connect, return_exceptions=True)
                return
            try:
                connect.result()
            except ShardError as e:
                self.down_reason = str(e)
                delay = BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)]
                log.warning("shard group not ready (%s); retrying in %.1f s", e, delay)
                attempt += 1
                try:
                    await asyncio.wait_for(stop.wait(), delay)
                except asyncio.TimeoutError:
                    pass
                continue
            if self.failures:
                self.recoveries += 1
                log.info("the shard group is back (recovery %d)", self.recoveries)
            attempt = 0
            await self._set_serving(True)
            failure, abandon = await self._serve(stop)
            await self._set_serving(False)
            self.engine.fail_all(failure)
            await self.shards.close_streams(abandon=abandon)
            if stop.is_set():
                return
            self.failures += 1
            self.down_reason = failure.message

    async def _serve(self, stop: asyncio.Event) -> tuple[Failure, bool]:
        """Runs the engine until the group fails or a drain ends. Returns what the requests
        still in flight are told, and whether the step streams are abandoned (cancelled)."""
        engine_task = asyncio.ensure_future(self.engine.run())
        ended_task = asyncio.ensure_future(self.shards.ended())
        stop_task = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait([engine_task, ended_task, stop_task], return_when=asyncio.FIRST_COMPLETED)
            if stop_task.done():
                self.accepting = False
                await self._set_serving(False)
                try:  # drain: what was accepted runs to completion, for a while
                    await asyncio.wait_for(asyncio.shield(self._drained(engine_task)), self.config.drain_timeout_s)
                except asyncio.TimeoutError:
                    log.warning("drain timed out after %.0f s", self.config.drain_timeout_s)
                if engine_task.done() and engine_task.exception() is not None:
                    return self._failure_of(engine_task.exception())
                return Failure("UNAVAILABLE", "the server is shutting down"), False
            if ended_task.done():
                why = ended_task.result()
                log.error("shard group failed: %s", why)
                return Failure("UNAVAILABLE", f"the replica failed while serving this request: {why}"), True
            return self._failure_of(engine_task.exception())
        finally:
            for task in (engine_task, ended_task, stop_task):
                task.cancel()
            await asyncio.gather(engine_task, ended_task, stop_task, return_exceptions=True)

    async def _drained(self, engine_task: asyncio.Future) -> None:
        while self.engine.has_work() and not engine_task.done():
            await asyncio.sleep(0.05)

    @staticmethod
    def _failure_of(error: BaseException) -> tuple[Failure, bool]:
        if isinstance(error, ShardError):
            log.error("shard group failed: %s", error)
            return Failure("UNAVAILABLE", f"the replica failed while serving this request: {error}"), True
        log.error("the step loop failed", exc_info=error)
        return Failure("INTERNAL", f"the router's step loop failed: {error!r}"), False

    async def _set_serving(self, serving: bool) -> None:
        self.serving = serving
        await self.on_serving(serving)

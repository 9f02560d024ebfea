"""The router's connection to its shard group, kept up for the router's whole life.

- connect: every shard's Info, checked to form one replica of the model the router serves, with
  its page size, dtype and a vocabulary that holds every token id its tokenizer makes; Warmup with
  the pool size (the smallest shard capacity, or `--num-pages`); a fresh page pool and prefix
  index. Then SERVING.
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
from typing import Awaitable, Callable

from shardline.protos import generation_pb2 as pb
from shardline.router.constraints import Grammars
from shardline.router.engine import Engine
from shardline.router.page_manager import PageManager
from shardline.router.scheduler import Scheduler
from shardline.router.sequence import Failure
from shardline.router.shard_client import ShardError, ShardGroup
from shardline.common.tokenizer import TextCodec

log = logging.getLogger("shardline.router")
BACKOFF_S = (0.5, 1, 2, 4, 5)


class Replica:
    def __init__(self, args, model_name: str, shards: ShardGroup, codec: TextCodec,
                 on_serving: Callable[[bool], Awaitable[None]], observers: list = ()):
        self.args, self.model_name, self.shards, self.codec = args, model_name, shards, codec
        self.observers = list(observers)
        self.on_serving = on_serving
        self.engine: Engine | None = None
        self.info: pb.InfoResponse | None = None
        self.eos_ids: frozenset[int] = frozenset()
        self.grammars: Grammars | None = None   # constraint compiler, once the vocabulary is known
        self.serving = False
        self.accepting = True          # false once a drain began
        self.down_reason = "connecting to the shards"
        self.failures = 0
        self.recoveries = 0

    # -- connect ------------------------------------------------------------------------------
    async def _connect(self) -> None:
        args = self.args
        infos = await self.shards.info(timeout=args.shard_timeout)
        head = infos[self.shards.sampler]
        wrong = [f"{what} {theirs!r} (the router's is {ours!r})" for what, theirs, ours in (
            ("model", head.model, self.model_name), ("page size", head.page_size, args.page_size),
            ("dtype", head.dtype, args.dtype)) if theirs != ours]
        if self.codec.vocab_size > head.vocab_size:
            wrong.append(f"vocabulary of {head.vocab_size} tokens (the router's tokenizer has "
                         f"{self.codec.vocab_size})")
        if wrong:
            raise ShardError("the shards serve a different model: " + "; ".join(wrong))
        capacity = min(i.max_pages for i in infos)
        num_pages = min(args.num_pages, capacity) if args.num_pages else capacity
        if num_pages < 1:
            raise ShardError(f"the shards have room for {capacity} pages; raise --kv-memory-gb")
        warmups = await self.shards.warmup(num_pages, args.max_batch)
        buckets = {tuple(w.decode_graph_buckets) for w in warmups}
        if len(buckets) > 1:  # every shard opened its step stream: the next attempt must find them closed
            await self.shards.close_streams(abandon=False)
            raise ShardError(f"the shards captured different decode graph buckets: {sorted(buckets)}")
        # Layer groups cut a long prompt's chunks (there are none without chunking); a mixed
        # step's decode rows run every layer, and pipeline stages run whole chunks.
        layer_groups = (min(args.layer_groups, head.num_layers)
                        if args.chunk_size and args.mixed_steps == "off" and head.pp_size == 1 else 1)
        self.info = pb.InfoResponse(
            model=head.model, page_size=head.page_size, num_pages=num_pages,
            tensor_parallel=head.tp_size, pipeline_parallel=head.pp_size, max_batch=args.max_batch,
            context_length=head.context_length, vocab_size=head.vocab_size, dtype=head.dtype,
            device=head.device, prefix_cache=args.prefix_cache == "on", eviction_policy=args.eviction,
            slru_protected_ratio=args.slru_protected_ratio, chunk_size=args.chunk_size,
            max_batch_tokens=args.max_batch_tokens, mixed_steps=args.mixed_steps == "on",
            layer_groups=layer_groups, step_timeout_s=args.step_timeout_s,
            drain_timeout_s=args.drain_timeout_s, shard_weight_bytes=max(i.weight_bytes for i in infos),
            shard_kv_pool_bytes=max(w.kv_pool_bytes for w in warmups),
            decode_graphs=bool(warmups[0].decode_graph_buckets), decode_graph_buckets=warmups[0].decode_graph_buckets,
            decode_graph_capture_s=max(w.capture_s for w in warmups),
            weight_formats={k: v for i in infos for k, v in i.weight_formats.items()}, kv_dtype=head.kv_dtype)
        eos = set(head.eos_token_ids)
        if self.codec.eos_token_id is not None:
            eos.add(self.codec.eos_token_id)
        self.eos_ids = frozenset(eos)
        if self.grammars is None:  # the model is the router's: it stays across reconnects
            self.grammars = Grammars(self.codec.tokenizer.to_str(), head.vocab_size, sorted(eos),
                                     args.constraint_timeout_s)
        pages = PageManager(num_pages, head.page_size, policy=args.eviction,
                            prefix_cache=args.prefix_cache == "on", protected_ratio=args.slru_protected_ratio,
                            model_key=f"{head.model}/{head.dtype}")
        scheduler = Scheduler(pages, args.max_batch, args.max_batch_tokens, chunk_size=args.chunk_size,
                              aging_s=args.priority_aging_s, mixed_steps=args.mixed_steps == "on",
                              pair_cost=head.attention_pair_cost, num_layers=head.num_layers, layer_groups=layer_groups)
        if self.engine is None:
            self.engine = Engine(scheduler, self.shards, self.codec, head.context_length, self.observers)
        else:  # the old pool described KV that is gone: start from an empty one
            self.engine.scheduler, self.engine.max_position = scheduler, head.context_length
        log.info("serving %s: TP%d x PP%d, %d pages of %d tokens", head.model, head.tp_size, head.pp_size,
                 num_pages, head.page_size)

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
                    await asyncio.wait_for(asyncio.shield(self._drained(engine_task)), self.args.drain_timeout_s)
                except asyncio.TimeoutError:
                    log.warning("drain timed out after %.0f s", self.args.drain_timeout_s)
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

"""The decoding side of the server: an `Engine` (anything that streams token ids) and ONE worker thread.

Requests queue to the worker; the event loop never runs model code. `DecodeWorker` is a thin adapter over
`resispec.serving.scheduler.Scheduler`, which batches requests continuously (an engine with a `batched` decoder) or
runs them one at a time (any other Engine), hands each step's new tokens to the request's asyncio queue, and checks
the request's cancel flag between steps, so a client that goes away frees its slot within one decode step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from resispec.decoding.batch import BatchedDecoder, BatchedSpeculativeDecoder
from resispec.sampling import SeedStream
from resispec.serving.scheduler import QueueFullError, RequestTooLargeError, Scheduler

SEEDED_SAMPLING = ("invariant", "rule")  # server.seeded_sampling

__all__ = [
    "DecodeWorker",
    "DecoderEngine",
    "Engine",
    "Job",
    "QueueFullError",
    "RequestTooLargeError",
    "SamplingParams",
]

log = logging.getLogger(__name__)


@dataclass
class SamplingParams:
    """Per-request decode settings (the config's `decode` defaults, overridden by OpenAI fields)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # score emitted tokens with the target, k alternatives each (logprobs.py)
    echo: bool = False  # with logprobs: score the prompt too


class Engine(Protocol):
    """What the worker drives. `stream` yields each step's new token ids; after it is exhausted or closed,
    `last_stats` holds that generation's DecodeStats (or None when the engine has none)."""

    last_stats: Any

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[list[int]]: ...


class DecoderEngine:
    """An Engine over `resispec.decoding.SpeculativeDecoder` (speculative) or its AR path (`speculative=False`).

    With `max_batch_size > 1` it also carries a batched decoder over the same pair (`batched`: speculative or AR
    as the engine), which the scheduler uses to decode many requests in one target forward per step. `kv_budget`
    (tokens, None = unbounded) bounds the batch cache; `max_prefill_tokens` the prompt tokens of newcomers
    prefilled together in one forward; `prefill_chunk_tokens` the part size of a long newcomer's prefill while
    others run (0 = in one go: chunked prefill, Scheduler); `prefix_cache_tokens` the tokens whose K/V the batched
    decoder keeps for reuse (per model; 0 = none: resispec.decoding.prefix_cache); `speculation` (auto | always |
    never) is the scheduler's per-step drafting policy; `trees_by_batch` (batch-size bucket -> tree, None = do not
    speculate; the planner's output under decode.tree=auto) is the tree speculative steps draft at each batch size;
    `greedy_trees_by_batch`
    the same for batches of greedy rows (None: `trees_by_batch`); `seeded_sampling` (invariant | rule) how a seeded
    request samples (`generator`); `threads_at` (running requests -> torch threads, server.threads_by_rows; None:
    leave torch's setting alone) what the scheduler decodes on."""

    def __init__(
        self,
        decoder,
        tokenizer,
        speculative: bool = True,
        max_batch_size: int = 1,
        kv_budget: int | None = None,
        max_prefill_tokens: int = 2048,
        prefill_chunk_tokens: int = 0,
        prefix_cache_tokens: int = 0,
        speculation: str = "auto",
        trees_by_batch: dict[int, list[int] | None] | None = None,
        greedy_trees_by_batch: dict[int, list[int] | None] | None = None,
        seeded_sampling: str = "invariant",
        threads_at=None,
    ) -> None:
        if seeded_sampling not in SEEDED_SAMPLING:
            raise ValueError(
                f"server.seeded_sampling must be one of {SEEDED_SAMPLING}, got {seeded_sampling!r}"
            )
        self.seeded_sampling = seeded_sampling
        self.threads_at = threads_at
        self.decoder = decoder
        self.trees_by_batch, self.greedy_trees_by_batch = trees_by_batch, greedy_trees_by_batch
        self.tokenizer = tokenizer
        self.speculative = speculative
        self.device = decoder.device
        eos = getattr(getattr(decoder.target, "generation_config", None), "eos_token_id", None)
        self.eos_token_id = eos if eos is not None else tokenizer.eos_token_id
        self.last_stats = None
        self.max_batch_size, self.kv_budget, self.speculation = max_batch_size, kv_budget, speculation
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.batched = None
        if max_batch_size > 1:
            batched = BatchedSpeculativeDecoder if speculative else BatchedDecoder
            self.batched = batched.from_decoder(decoder)
            self.batched.enable_prefix_cache(prefix_cache_tokens)

    def generator(self, params: SamplingParams) -> torch.Generator | SeedStream:
        """The request's random stream. Under seeded_sampling=invariant a seeded request gets a SeedStream: its
        noise is keyed by token position, so its tokens are the same with or without speculation, with any tree
        and any neighbours, and the scheduler may switch speculation for it by load (it verifies with the `gumbel`
        rule). Otherwise a torch.Generator (seeded, or fresh entropy) and the configured rule."""
        if params.seed is not None and self.seeded_sampling == "invariant":
            return SeedStream(params.seed)
        generator = torch.Generator(device=self.device)
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()
        return generator

    def eos(self, params: SamplingParams):
        return [] if params.ignore_eos else self.eos_token_id

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[list[int]]:
        it = self.decoder.generate_stream(
            torch.tensor([prompt_ids], device=self.device),  # [1, L]
            max_new_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            eos_token_id=self.eos(params),
            stop=params.stop or None,
            generator=self.generator(params),
            speculative=self.speculative,
        )
        self.last_stats = self.decoder.last_stats
        return it


_DONE = object()


class Job:
    """One request's generation. The worker pushes token chunks; the event loop awaits `next_event`."""

    def __init__(
        self, prompt_ids: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.prompt_ids, self.params, self.loop = prompt_ids, params, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.stats: Any = None
        self.error: BaseException | None = None
        self.result: Any = None  # filled by the app (text, token count, finish reason)
        self.logprobs: list = []  # TokenLogprob per emitted token, extended before each chunk is put
        self.prompt_logprobs: list | None = None  # with echo: set before the first chunk or the end is put
        self.submitted = time.perf_counter()
        self.on_cancel: Any = None  # set by the scheduler
        self.outbox: Any = None  # set by the scheduler: its decode thread's hand-offs go out once per cycle

    def cancel(self) -> None:
        """Ask the worker to stop this generation (or skip it when still queued). Safe from any thread."""
        if not self.cancelled.is_set():
            self.cancelled.set()
            if self.on_cancel is not None:
                self.on_cancel()  # the gauges stop counting it now, not at the next step boundary

    def _put(self, item: Any) -> None:
        if self.outbox is not None:
            self.outbox.put(self, item)
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop is gone (server shutting down): nobody is listening
            self.cancel()

    def finish(self) -> None:
        """The generation is over (done, cancelled or failed): end the request's chunk stream."""
        self._put(_DONE)

    async def chunks(self) -> AsyncIterator[list[int]]:
        """Async iterator over token chunks; raises the worker's error, if any, at the end."""
        while True:
            item = await self.events.get()
            if item is _DONE:
                if self.error is not None:
                    raise self.error
                return
            yield item


class DecodeWorker:
    """The app's handle on decoding: submit Jobs, read the gauges, close. Scheduling lives in `Scheduler`."""

    def __init__(self, engine: Engine, max_queue: int = 64, metrics=None) -> None:
        self.engine = engine
        self.scheduler = Scheduler(
            engine,
            max_batch_size=getattr(engine, "max_batch_size", 1),
            kv_budget=getattr(engine, "kv_budget", None),
            max_prefill_tokens=getattr(engine, "max_prefill_tokens", 2048),
            prefill_chunk_tokens=getattr(engine, "prefill_chunk_tokens", 0),
            speculation=getattr(engine, "speculation", "auto"),
            max_queue=max_queue,
            metrics=metrics,
            threads_at=getattr(engine, "threads_at", None),
        )

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Job:
        """Queue a generation (QueueFullError when the queue is full, RequestTooLargeError when it can never fit)."""
        job = Job(prompt_ids, params, asyncio.get_running_loop())
        self.scheduler.enqueue(job)
        return job

    def close(self, timeout: float = 5.0) -> None:
        """Cancel running and queued generations and stop the thread (server shutdown)."""
        self.scheduler.close(timeout)

"""The decoding side of the server: an `Engine` (anything that streams token ids) and ONE worker thread.

Requests queue to the worker; the event loop never runs model code. The worker runs one generation at a time
(the decoder is batch 1), hands each step's new tokens to the request's asyncio queue, and checks the request's
cancel flag between steps, so a client that goes away frees the worker within one decode step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from resispec.serving.logprobs import start_scoring

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
    """An Engine over `resispec.decoding.SpeculativeDecoder` (speculative) or its AR path (`speculative=False`)."""

    def __init__(self, decoder, tokenizer, speculative: bool = True) -> None:
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.speculative = speculative
        self.device = decoder.device
        eos = getattr(getattr(decoder.target, "generation_config", None), "eos_token_id", None)
        self.eos_token_id = eos if eos is not None else tokenizer.eos_token_id
        self.last_stats = None

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[list[int]]:
        generator = torch.Generator(device=self.device)
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()  # fresh entropy per request
        it = self.decoder.generate_stream(
            torch.tensor([prompt_ids], device=self.device),  # [1, L]
            max_new_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            eos_token_id=[] if params.ignore_eos else self.eos_token_id,
            stop=params.stop or None,
            generator=generator,
            speculative=self.speculative,
        )
        self.last_stats = self.decoder.last_stats
        return it


class QueueFullError(RuntimeError):
    pass


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

    def cancel(self) -> None:
        """Ask the worker to stop this generation (or skip it when still queued). Safe from any thread."""
        self.cancelled.set()

    def _put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop is gone (server shutting down): nobody is listening
            self.cancel()

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
    """One daemon thread running queued Jobs in order on the engine."""

    def __init__(self, engine: Engine, max_queue: int = 64, metrics=None) -> None:
        self.engine, self.max_queue, self.metrics = engine, max_queue, metrics
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self.num_waiting = 0
        self.num_running = 0
        self._current: Job | None = None
        self._thread = threading.Thread(target=self._run, name="resispec-decode", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Job:
        with self._lock:
            if self.num_waiting >= self.max_queue:
                raise QueueFullError(f"the request queue is full ({self.max_queue} waiting); retry later")
            self.num_waiting += 1
            self._gauges()
        job = Job(prompt_ids, params, asyncio.get_running_loop())
        self._queue.put(job)
        return job

    def close(self, timeout: float = 5.0) -> None:
        """Stop after the running generation, which is cancelled (server shutdown)."""
        self._queue.put(None)
        current = self._current
        if current is not None:
            current.cancel()
        self._thread.join(timeout)

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.waiting.labels(self.metrics.model_name).set(self.num_waiting)
            self.metrics.running.labels(self.metrics.model_name).set(self.num_running)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                self.num_waiting -= 1
                self.num_running = 1
                self._current = job
                self._gauges()
            try:
                if not job.cancelled.is_set():  # a client that left while queued costs nothing
                    self._generate(job)
            except BaseException as exc:  # report to the request, keep serving
                log.exception("generation failed")
                job.error = exc
            finally:
                with self._lock:
                    self.num_running = 0
                    self._current = None
                    self._gauges()
                job._put(_DONE)

    def _generate(self, job: Job) -> None:
        scorer = start_scoring(self.engine, job.prompt_ids, job.params)  # None unless logprobs are asked
        job.prompt_logprobs = scorer and scorer.prompt
        it = self.engine.stream(job.prompt_ids, job.params)
        try:
            for chunk in it:
                if chunk:
                    if scorer is not None:
                        job.logprobs.extend(scorer.add(chunk))
                    job._put(list(chunk))
                if job.cancelled.is_set():
                    break
        finally:
            it.close()  # stops the decoder mid-generation; its stats are final after close
            job.stats = getattr(self.engine, "last_stats", None)
            if self.metrics is not None and job.stats is not None:
                self.metrics.observe_spec(job.stats)

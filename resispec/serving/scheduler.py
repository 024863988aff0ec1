"""Continuous batching (DESIGN.md "Batched decoding and scheduling"): one thread owns the models and serves every
request, admitting waiting ones and retiring finished or cancelled ones at step boundaries.

Paths a request can take:
  batch   a row of the engine's `BatchedDecoder` (batched autoregressive decoding, one target forward per step for
          every row). Used whenever more than one request runs.
  spec    the batch-1 speculative decoder, for a request that runs ALONE, when the measured cost says it pays (below).
          When a second request arrives, the speculative request migrates into the batch: its prompt plus the tokens
          emitted so far are prefilled as a batch row (one prefill) and it continues there with the same generator
          (greedy and unseeded requests only; a seeded sampled one stays speculative, next to the batch).
  stream  an engine without a batched decoder (or max_batch_size = 1): one request at a time, the old behaviour.

Adaptive speculation (`server.speculation: auto`; `always` sends every lone request to the speculative path, `never`
keeps everything on the batch), by measured cost: the scheduler keeps the seconds per emitted token of the last
COST_WINDOW steps of the speculative path (alone; a step's time over the tokens it emitted, the prefill step
excluded) and of the batched path with one row, and compares their medians. A lone request goes speculative
when that path has not been measured yet or measures cheaper; the batched path is measured on the second lone
request, and every `EXPLORE_EVERY`-th lone request takes the losing path to re-measure it. Above one running request the batch always wins on this hardware
(a tree verify of k nodes costs about a forward of k tokens, which the batch spends on other rows instead).
A seeded sampled request never changes path once started (a speculative one keeps decoding speculatively next
to the batch), so with a given seed its tokens depend only on whether it arrived alone, never on its neighbours.

Bounds: at most `max_batch_size` running requests; with `kv_budget` (tokens), a request is admitted only while
(running + 1) x the longest worst-case length (prompt + max_tokens) fits in the budget, so the cache can never
outgrow it; a request that alone exceeds it is refused (RequestTooLargeError -> 400). A newcomer's prefill runs
alone between two steps, and at most one per step boundary while others run, so running streams stall for at most
one prefill.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

EXPLORE_EVERY = 16  # every so many lone requests, the path that measured slower is measured again
COST_WINDOW = 32  # recent per-token costs kept per path; the policy compares medians
SPECULATION = ("auto", "always", "never")  # lone requests: by measured cost, always speculative, never


class QueueFullError(RuntimeError):
    """Too many requests waiting (503, retry later)."""


class RequestTooLargeError(ValueError):
    """The request's prompt + max_tokens can never fit in the KV budget (400)."""


@dataclass(eq=False)
class _Task:
    """One running request."""

    job: Any
    path: str  # "batch" | "spec" | "stream"
    generator: Any = None
    row: Any = None  # BatchRow on the batch path
    stream: Any = None  # token-chunk iterator on the spec/stream paths
    stats: Any = None
    generated: list[int] = field(default_factory=list)

    @property
    def worst_len(self) -> int:
        return len(self.job.prompt_ids) + self.job.params.max_new_tokens


def _seeded(params) -> bool:
    """A seeded sampled request: its tokens must not depend on when it moves between paths."""
    return params.seed is not None and params.temperature > 0


class Scheduler:
    """Runs submitted jobs on `engine` in one daemon thread (see the module docstring)."""

    def __init__(
        self,
        engine,
        max_batch_size: int = 1,
        kv_budget: int | None = None,
        max_queue: int = 64,
        metrics=None,
        speculation: str = "auto",
    ) -> None:
        if speculation not in SPECULATION:
            raise ValueError(f"speculation must be one of {SPECULATION}, got {speculation!r}")
        self.engine, self.metrics, self.speculation = engine, metrics, speculation
        self.batched = getattr(engine, "batched", None) if max_batch_size > 1 else None
        self.max_batch_size = max_batch_size if self.batched is not None else 1
        self.kv_budget, self.max_queue = kv_budget, max_queue
        self.speculative = bool(getattr(engine, "speculative", False))
        self.samples: dict[str, deque] = {k: deque(maxlen=COST_WINDOW) for k in ("spec", "batch1")}
        self.num_lone = 0
        self.peak_running = 0  # most requests decoded together so far
        self.waiting: deque = deque()
        self.tasks: list[_Task] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="resispec-decode", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ called from the event loop
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.tasks)

    def enqueue(self, job) -> None:
        need = len(job.prompt_ids) + job.params.max_new_tokens
        if self.kv_budget is not None and need > self.kv_budget:
            raise RequestTooLargeError(
                f"prompt + max_tokens = {need} tokens can never fit in the server's KV budget "
                f"({self.kv_budget} tokens); shorten the prompt or lower max_tokens"
            )
        with self._cv:
            if len(self.waiting) >= self.max_queue:
                raise QueueFullError(f"the request queue is full ({self.max_queue} waiting); retry later")
            self.waiting.append(job)
            self._gauges()
            self._cv.notify()

    def close(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._closed = True
            for job in list(self.waiting) + [t.job for t in self.tasks]:
                job.cancel()
            self._cv.notify()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the decode thread
    def _gauges(self) -> None:
        self.peak_running = max(self.peak_running, len(self.tasks))
        if self.metrics is not None:
            self.metrics.waiting.labels(self.metrics.model_name).set(len(self.waiting))
            self.metrics.running.labels(self.metrics.model_name).set(len(self.tasks))

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self.waiting and not self.tasks:
                    self._cv.wait()
                if self._closed:
                    break
            try:
                self._admit()
                self._step()
            except BaseException as exc:  # a failed step fails the requests in it; keep serving
                log.exception("decode step failed")
                for task in list(self.tasks):
                    self._finish(task, exc)
                if self.batched is not None:
                    self.batched.reset()
        for task in list(self.tasks):
            self._finish(task)
        while self.waiting:
            self.waiting.popleft().finish()

    def _fits(self, job) -> bool:
        if len(self.tasks) >= self.max_batch_size:
            return False
        if self.kv_budget is None:
            return True
        longest = max([t.worst_len for t in self.tasks] + [len(job.prompt_ids) + job.params.max_new_tokens])
        return (len(self.tasks) + 1) * longest <= self.kv_budget

    def _admit(self) -> None:
        """Admit waiting jobs that fit: all that fit when nothing runs, else one per step boundary."""
        busy = bool(self.tasks)
        while True:
            with self._cv:
                while self.waiting and self.waiting[0].cancelled.is_set():
                    self.waiting.popleft().finish()  # a client that left while queued costs nothing
                if not self.waiting or not self._fits(self.waiting[0]):
                    self._gauges()
                    return
                spec = [t for t in self.tasks if t.path == "spec" and not _seeded(t.job.params)]
                if spec:  # a newcomer: the lone speculative request moves into the batch first
                    job = None
                else:
                    job = self.waiting.popleft()
                self._gauges()
            if job is None:
                self._migrate(spec[0])
            else:
                self._start(job, alone=not self.tasks and not self.waiting)
            if busy:
                return

    def _start(self, job, alone: bool) -> None:
        task = _Task(job=job, path="stream")
        try:
            if self.batched is None:
                task.stream = self.engine.stream(job.prompt_ids, job.params)
                task.stats = getattr(self.engine, "last_stats", None)
            else:
                task.generator = self.engine.generator(job.params)
                if alone and self._use_spec(job):
                    task.path = "spec"
                    task.stream = self.engine.stream(job.prompt_ids, job.params, task.generator, True)
                    task.stats = self.engine.last_stats
                else:
                    task.path = "batch"
                    task.row = self._add_row(task)
                    task.stats = task.row.stats
        except BaseException as exc:
            log.exception("admission failed")
            self._finish(task, exc)
            return
        self.tasks.append(task)
        if task.row is not None and task.row.finished:  # max_tokens 0
            self._finish(task)
        self._gauges()

    def _use_spec(self, job) -> bool:
        """The adaptive policy for a lone request (see the module docstring)."""
        if not self.speculative or self.speculation == "never":
            return False
        if self.speculation == "always":
            return True
        self.num_lone += 1
        spec, batch1 = self.cost("spec"), self.cost("batch1")
        if spec is None:
            return True
        if batch1 is None:
            return False
        explore = self.num_lone % EXPLORE_EVERY == 0  # now and then, re-measure the path that lost
        return (spec < batch1) != explore

    def _add_row(self, task: _Task):
        """Prefill `task` (prompt + what it already emitted) as a batch row."""
        job, engine = task.job, self.engine
        p, prev = job.params, list(task.generated)
        check = None
        if p.stop:
            from resispec.decoding.stopping import make_stop_string_checker

            stop = make_stop_string_checker(engine.tokenizer, p.stop)

            def check(ids: list[int]) -> bool:
                return stop(prev + ids)

        return self.batched.add(
            list(job.prompt_ids) + prev,
            max_new_tokens=p.max_new_tokens - len(prev),
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            eos_token_id=engine.eos(p),
            stop_checker=check,
            generator=task.generator,
        )

    def _migrate(self, task: _Task) -> None:
        """Move the lone speculative request into the batch (one prefill of its prompt + emitted tokens)."""
        task.stream.close()
        task.stream, task.path = None, "batch"
        task.row = self._add_row(task)
        if task.row.finished:
            self._finish(task)

    def _step(self) -> None:
        for task in [t for t in self.tasks if t.stream is not None]:
            t0 = time.perf_counter()
            try:
                chunk = next(task.stream, None)
            except Exception as exc:  # this request fails; the others go on
                log.exception("generation failed")
                self._finish(task, exc)
                continue
            dt = time.perf_counter() - t0
            if chunk is None:
                self._finish(task)
                continue
            if chunk:
                if task.path == "spec" and task.generated:  # the first chunk also paid the prefill
                    self._measure("spec", dt / len(chunk))
                task.generated.extend(chunk)
                task.job._put(list(chunk))
            if task.job.cancelled.is_set():
                self._finish(task)
        rows = {id(t.row): t for t in self.tasks if t.row is not None}
        for task in list(rows.values()):
            if task.job.cancelled.is_set():
                self.batched.remove(task.row)
                self._finish(task)
                del rows[id(task.row)]
        if rows:
            t0 = time.perf_counter()
            out = self.batched.step()
            if len(out) == 1:
                self._measure("batch1", time.perf_counter() - t0)
            for row, chunk in out:
                task = rows[id(row)]
                task.generated.extend(chunk)
                task.job._put(list(chunk))
                if row.finished:
                    self._finish(task)

    def _measure(self, path: str, seconds_per_token: float) -> None:
        self.samples[path].append(seconds_per_token)

    def cost(self, path: str) -> float | None:
        """Median seconds per emitted token of `path` ("spec": speculative alone; "batch1": the batch with one
        row) over the recent steps; None before the first measurement."""
        samples = sorted(self.samples[path])
        return samples[len(samples) // 2] if samples else None

    def _finish(self, task: _Task, error: BaseException | None = None) -> None:
        if task in self.tasks:
            self.tasks.remove(task)
        if task.stream is not None:
            task.stream.close()  # stops the decoder mid-generation; its stats are final after close
        if task.row is not None and not task.row.finished and self.batched is not None:
            self.batched.remove(task.row)
        job = task.job
        job.error = error
        job.stats = task.stats
        if self.metrics is not None and job.stats is not None and error is None:
            self.metrics.observe_spec(job.stats)
        job.finish()
        self._gauges()

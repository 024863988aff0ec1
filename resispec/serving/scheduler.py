"""Continuous batching (docs/design.md "Batched decoding and scheduling"): one thread owns the models and serves every
request, admitting waiting ones and retiring finished or cancelled ones at step boundaries.

Paths a request can take:
  batch   a row of the engine's batched decoder: `BatchedSpeculativeDecoder` when the engine is speculative (per-row
          draft trees, one draft forward per depth and ONE target forward per step for every row), `BatchedDecoder`
          (batched autoregressive) otherwise.
  stream  an engine without a batched decoder (or max_batch_size = 1): one request at a time, the old behaviour.

Speculation adapts to load (`server.speculation`: auto | always | never), step by step: the batched speculative
decoder can take a plain autoregressive step for any row (`step(draft=flags)`) and stay exact. Under `auto` the
scheduler keeps an online cost model of each mode (`StepCostModel`; per drafted tree and, as greedy rows accept
more, per class: every row greedy or not): the seconds of its recent pure steps (the last MODEL_WINDOW of each
batch-size bucket), each timed over its whole scheduler cycle (`_cycle`: a newcomer's admission merges its row into
caches that drafting leaves wider), as a line in the number of rows weighted towards the row count asked about, and
the tokens each row emits per step. It drafts at R rows when the model predicts fewer seconds per emitted token for
drafting than for AR steps at R rows; coming from AR, only below SWITCH_MARGIN (the drafting step after AR steps
feeds the draft every token it skipped, so flipping back and forth costs), or below AGAINST_PLAN_MARGIN where the
planner found that speculation does not pay at that batch size (the online model is noisy; the plan is a second
opinion), and there it goes on drafting only while below AGAINST_PLAN_KEEP. Every pure step at every batch size
feeds its mode's model, so a decision is not taken on a handful of steps, but the model decides at a batch-size
bucket only once both modes have MIN_SAMPLES steps in it: until then the planner's plan decides there (drafting
unless it planned none at that batch size), as it was measured there and a line through other sizes' steps is an
extrapolation. To measure, the preferred mode is left for PROBE_STEPS steps, every WARMUP_EVERY-th step until the
model is ready (from a batch size's first step; where the plan says not to speculate, after every EXPLORE_EVERY
steps) and after every EXPLORE_EVERY steps at that batch size once it is (4x less often while the ratio is beyond
CLEAR_MARGIN, or while the model and the plan agree that speculation does not pay). Where the plan says not to
speculate, no drafting probe starts while the batch is in lockstep (equal requests admitted together;
`in_lockstep`): its rows would accept different numbers of tokens and stay staggered. A drafting step right after
steps with AR rows is not measured (it carries that catch-up). `cost_table()` shows per batch-size bucket the
measured medians per mode, the model's ratio at the bucket's size and the share of steps that drafted; an INFO line
every LOG_EVERY steps says the same. Under decode.tree=auto the plan has two halves: a batch of greedy rows drafts
the tree planned at temperature 0 (`greedy_trees_by_batch`), any other batch the tree planned at the sampled
temperature. A seeded request's tokens never depend on its neighbours, the load or the mode: its row samples with a
SeedStream (noise keyed by token position, verified with the `gumbel` rule), which emits the same token at every
position whether the row drafted or not, so the policy treats it as any other row.

Bounds: at most `max_batch_size` running requests; with `kv_budget` (tokens), a request is admitted only while
(running + 1) x the longest worst-case row fits (prompt + max_tokens; on the speculative batch with room for the
holes rejected tree nodes leave until a repack), so the cache can never outgrow it; a request that alone exceeds it
is refused (RequestTooLargeError -> 400). Newcomers are prefilled together between two steps, in one target forward
(`add_many`) over at most `max_prefill_tokens` prompt tokens (at least one request); while others run, one such
block per step boundary, so running streams stall for at most one prefill forward. A newcomer whose prompt is
longer than `prefill_chunk_tokens` (0 = never) is prefilled in parts while others run (chunked prefill, as vLLM's):
one part of at most that many tokens per step boundary (`prefill_part`, into caches of its own, outside the batch),
and it joins with the last part. A long prompt then delays each running stream's next token by one part's forward,
not by its whole prefill. When nothing runs, it is prefilled in one go.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from resispec.serving.logprobs import start_scoring
from resispec.serving.policy import LOG_EVERY, SpeculationPolicy, bucket

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """Too many requests waiting (503, retry later)."""


class RequestTooLargeError(ValueError):
    """The request's prompt + max_tokens can never fit in the KV budget (400)."""


class Outbox:
    """What the decode thread hands to requests during one cycle (token chunks, ends), delivered when the cycle is
    over: one wake-up of each event loop per cycle, where one per request and chunk cost the decode thread 5% of its
    time at 8 clients (each cross-thread wake-up writes to the loop's self-pipe and waits for the interpreter)."""

    def __init__(self) -> None:
        self._items: list = []

    def put(self, job, item) -> None:
        self._items.append((job, item))

    def flush(self) -> None:
        """Deliver what was put, in order, with one call_soon_threadsafe per event loop."""
        items, self._items = self._items, []
        by_loop: dict = {}
        for job, item in items:
            by_loop.setdefault(job.loop, []).append((job, item))
        for loop, puts in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, puts)
            except RuntimeError:  # the loop is gone (server shutting down): nobody is listening
                for job, _ in puts:
                    job.cancel()


def _deliver(puts: list) -> None:
    for job, item in puts:
        job.events.put_nowait(item)


@dataclass(eq=False)
class _Task:
    """One running request."""

    job: Any
    path: str  # "batch" | "stream"
    generator: Any = None
    row: Any = None  # BatchRow on the batch path
    stream: Any = None  # token-chunk iterator on the stream path
    stats: Any = None
    scorer: Any = None  # logprobs.Scorer when the request asked for log-probs

    def emit(self, chunk) -> None:
        """Hand a chunk of new tokens to the request, scored first when it asked for log-probs."""
        if self.scorer is not None:
            self.job.logprobs.extend(self.scorer.add(chunk))
        self.job._put(list(chunk))


class Scheduler(SpeculationPolicy):
    """Runs submitted jobs on `engine` in one daemon thread (see the module docstring); the speculation policy is
    its base (policy.py)."""

    def __init__(
        self,
        engine,
        max_batch_size: int = 1,
        kv_budget: int | None = None,
        max_queue: int = 64,
        metrics=None,
        speculation: str = "auto",
        max_prefill_tokens: int = 2048,
        threads_at=None,
        prefill_chunk_tokens: int = 0,
    ) -> None:
        if max_prefill_tokens < 1:
            raise ValueError(f"server.max_prefill_tokens must be at least 1, got {max_prefill_tokens}")
        batched = getattr(engine, "batched", None) if max_batch_size > 1 else None
        super().__init__(
            batched,
            speculation,
            getattr(engine, "trees_by_batch", None),
            getattr(engine, "greedy_trees_by_batch", None),
        )
        self.engine, self.metrics = engine, metrics
        # running requests -> torch threads to decode on (server.threads_by_rows), set before each cycle
        self.threads_at, self._threads = threads_at, None
        self.max_batch_size = max_batch_size if self.batched is not None else 1
        if prefill_chunk_tokens < 0:
            raise ValueError(f"server.prefill_chunk_tokens must be >= 0, got {prefill_chunk_tokens}")
        self.kv_budget, self.max_queue, self.max_prefill_tokens = kv_budget, max_queue, max_prefill_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.speculative = bool(getattr(engine, "speculative", False))
        self.spec_batch = self.batched is not None and getattr(self.batched, "draft", None) is not None
        if self.spec_batch:  # a batch that never drafts leaves the draft unfed
            self.batched.prefill_draft = speculation != "never"
        self._steps = 0  # batch steps taken
        # the last step had rows that did not draft (the next drafting step catches up)
        self._ar_rows_before = False
        # (drafted, rows, tokens, greedy) of this cycle's pure step, for _cycle
        self._pure: tuple | None = None
        self._prefill_seconds = 0.0  # the target prefills of this cycle's newcomers (left out of its cost)
        self.peak_running = 0  # most requests decoded together so far
        self.waiting: deque = deque()
        self.tasks: list[_Task] = []
        self._cv = threading.Condition()
        self._closed = False
        self._outbox = Outbox()  # the decode thread's hand-offs, delivered once per cycle
        # (job, PartialPrefill): the queue head's prefill so far (chunked prefill)
        self._part: tuple | None = None
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
        need = self._columns(job)
        if self.kv_budget is not None and need > self.kv_budget:
            raise RequestTooLargeError(
                f"prompt + max_tokens = {need} tokens can never fit in the server's KV budget "
                f"({self.kv_budget} tokens); shorten the prompt or lower max_tokens"
            )
        with self._cv:
            if len(self.waiting) >= self.max_queue:
                raise QueueFullError(f"the request queue is full ({self.max_queue} waiting); retry later")
            job.on_cancel = self._gauges
            job.outbox = self._outbox
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
        """vLLM's gauges; a cancelled request no longer counts (it leaves at the next step boundary)."""
        self.peak_running = max(self.peak_running, len(self.tasks))
        if self.metrics is not None:
            live = [j for j in list(self.waiting) if not j.cancelled.is_set()]
            self.metrics.waiting.labels(self.metrics.model_name).set(len(live))
            live = [t for t in list(self.tasks) if not t.job.cancelled.is_set()]
            self.metrics.running.labels(self.metrics.model_name).set(len(live))

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self.waiting and not self.tasks:
                    self._cv.wait()
                if self._closed:
                    break
            try:
                self._cycle()
            except BaseException as exc:  # a failed step fails the requests in it; keep serving
                log.exception("decode step failed")
                for task in list(self.tasks):
                    self._finish(task, exc)
                if self.batched is not None:
                    self.batched.reset()
            finally:
                self._outbox.flush()
        for task in list(self.tasks):
            self._finish(task)
        while self.waiting:
            self.waiting.popleft().finish()
        self._outbox.flush()

    def _columns(self, job) -> int:
        """Most cache columns the job's row can need: prompt + max_tokens; on the speculative batch, rejected tree
        nodes leave holes until the cache is repacked (at 2 x the longest row + 16), plus one step's tree."""
        n = len(job.prompt_ids) + job.params.max_new_tokens
        return 2 * n + 17 + self.batched.max_nodes if self.spec_batch else n

    def _fits(self, job, admitting: list) -> bool:
        """`job` fits next to the running requests and those `admitting` with it."""
        if len(self.tasks) + len(admitting) >= self.max_batch_size:
            return False
        if self.kv_budget is None:
            return True
        longest = max(self._columns(j) for j in [t.job for t in self.tasks] + admitting + [job])
        return (len(self.tasks) + len(admitting) + 1) * longest <= self.kv_budget

    def _cycle(self) -> None:
        """Admit, step, emit. A pure batch step is measured over the whole cycle: the newcomer's admission (merging
        its row into caches that drafting leaves wider, with holes) and the hand-off of the chunks are costs of the
        mode too. Its target prefill is not: both modes pay it alike, and at ~45 ms (a 65-token prompt, one core)
        against 12-25 ms steps at one row, it was noise in the mode that happened to step next. A cycle that
        admits a whole wave at once is not measured."""
        t0 = time.perf_counter()
        self._prefill_seconds = 0.0
        if self.threads_at is not None:
            self._set_threads(min(len(self.tasks) + len(self.waiting), self.max_batch_size))
        admitted = self._admit()
        self._pure = None
        self._step()
        if self._pure is not None and admitted <= 1:
            self._measure(*self._pure, time.perf_counter() - t0 - self._prefill_seconds)

    def _set_threads(self, rows: int) -> None:
        """Torch's threads for a cycle of about `rows` requests (the running ones and those that may join)."""
        import torch

        threads = self.threads_at(max(rows, 1))
        if threads != self._threads:
            torch.set_num_threads(threads)
            self._threads = threads

    def _admit(self) -> int:
        """Admit waiting jobs that fit, prefilled together (one target forward for all of them): when nothing
        runs, every one that fits, in blocks of max_prefill_tokens prompt tokens; else one block per step
        boundary (at least one job). -> how many."""
        busy, admitted = bool(self.tasks), 0
        while True:
            jobs, tokens, chunk = [], 0, None
            with self._cv:
                while True:
                    while self.waiting and self.waiting[0].cancelled.is_set():
                        gone = self.waiting.popleft()
                        gone.finish()  # a client that left while queued costs nothing
                        if self._part_of(gone) is not None:
                            self._part = None  # nor does the part of its prefill done so far
                    if not self.waiting or not self._fits(self.waiting[0], jobs):
                        break
                    job = self.waiting[0]
                    need = self._prefill_need(job)
                    long = busy and self.batched is not None and 0 < self.prefill_chunk_tokens < need
                    if jobs and (long or tokens + need > self.max_prefill_tokens):
                        break
                    if long:  # too long to prefill between two steps: one part now, at the queue's head
                        chunk = job
                        break
                    jobs.append(self.waiting.popleft())
                    tokens += need
                self._gauges()
            if chunk is not None:
                self._prefill_part(chunk)
                return admitted
            if not jobs:
                return admitted
            self._start(jobs)
            admitted += len(jobs)
            if busy:
                return admitted

    def _part_of(self, job):
        """The job's PartialPrefill so far, if its prefill was started in parts; else None."""
        return self._part[1] if self._part is not None and self._part[0] is job else None

    def _prefill_need(self, job) -> int:
        """Prompt tokens the job's prefill would still forward (all of them, less what its parts did)."""
        part = self._part_of(job)
        return len(job.prompt_ids) if part is None else part.remaining + 1

    def _prefill_part(self, job) -> None:
        """One part (prefill_chunk_tokens) of the queue head's prefill, kept until the job joins; a failure fails
        the job (it leaves the queue)."""
        part = self._part_of(job)
        t0 = time.perf_counter()
        try:
            part = self.batched.prefill_part(job.prompt_ids, self.prefill_chunk_tokens, part)
        except BaseException as exc:
            log.exception("prefill failed")
            self._part = None
            with self._cv:
                if self.waiting and self.waiting[0] is job:
                    self.waiting.popleft()
                self._gauges()
            job.error = exc
            job.finish()
            return
        self._prefill_seconds += time.perf_counter() - t0
        self._part = (job, part)

    def _take_part(self, job):
        """The job's PartialPrefill, if its prefill was started in parts (it joins now: the slot is freed)."""
        part = self._part_of(job)
        if part is None:
            return None
        self._part = None
        self._prefill_seconds -= sum(part.seconds.values())  # counted in the cycles that ran the parts
        return part

    def _start(self, jobs: list) -> None:
        """Start `jobs`: their scorers and random streams, then their rows, prefilled together (add_many); if
        that fails, one by one, so that only a job that fails alone fails."""
        tasks = []
        for job in jobs:
            task = _Task(job=job, path="stream")
            try:
                task.scorer = start_scoring(self.engine, job.prompt_ids, job.params)  # None unless asked
                job.prompt_logprobs = task.scorer and task.scorer.prompt
                if self.batched is None:
                    task.stream = self.engine.stream(job.prompt_ids, job.params)
                    task.stats = getattr(self.engine, "last_stats", None)
                else:
                    task.path = "batch"
                    task.generator = self.engine.generator(job.params)
            except BaseException as exc:
                log.exception("admission failed")
                self._finish(task, exc)
                continue
            tasks.append(task)
        batch = [t for t in tasks if t.path == "batch"]
        rows: list = []
        if len(batch) == 1:
            rows = [self._add_alone(batch[0])]
        elif batch:
            try:
                rows = self.batched.add_many([self._row_request(t) for t in batch])
            except BaseException:
                log.exception("admitting %d requests together failed; admitting them one by one", len(batch))
                rows = [self._add_alone(t) for t in batch]
        if self.metrics is not None and getattr(self.batched, "prefix", None) is not None:
            added = [r for r in rows if r is not None and not r.finished]
            self.metrics.observe_prefix(
                sum(len(r.prompt) - 1 for r in added), sum(r.stats.cached_prompt_tokens for r in added)
            )
        for task, row in zip(batch, rows, strict=True):
            task.row, task.stats = row, row and row.stats
            # so far only its prefills (the target's, and on the speculative batch the draft's)
            if row is not None:
                self._prefill_seconds += row.stats.target_seconds + row.stats.draft_seconds
        for task in tasks:
            if task.path == "batch" and task.row is None:
                continue  # failed above
            self.tasks.append(task)
            if task.row is not None and task.row.finished:  # max_tokens 0
                self._finish(task)
        self._gauges()

    def _add_alone(self, task: _Task):
        """`task`'s row, prefilled alone; None when that fails (the task is finished with the error)."""
        try:
            return self.batched.add_many([self._row_request(task)])[0]
        except BaseException as exc:
            log.exception("admission failed")
            self._finish(task, exc)
            return None

    def _row_request(self, task: _Task) -> dict:
        """add_many's entry for `task`'s row."""
        p = task.job.params
        return dict(
            prompt_ids=list(task.job.prompt_ids),
            max_new_tokens=p.max_new_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            eos_token_id=self.engine.eos(p),
            stop=p.stop or None,
            generator=task.generator,
            partial=self._take_part(task.job),
        )

    def _step(self) -> None:
        for task in [t for t in self.tasks if t.stream is not None]:
            try:
                chunk = next(task.stream, None)
            except Exception as exc:  # this request fails; the others go on
                log.exception("generation failed")
                self._finish(task, exc)
                continue
            if chunk is None:
                self._finish(task)
                continue
            if chunk:
                task.emit(chunk)
            if task.job.cancelled.is_set():
                self._finish(task)
        rows = {id(t.row): t for t in self.tasks if t.row is not None}
        for task in list(rows.values()):
            if task.job.cancelled.is_set():
                self.batched.remove(task.row)
                self._finish(task)
                del rows[id(task.row)]
        if rows:
            out = self._batch_step()
            for row, chunk in out:
                task = rows[id(row)]
                task.emit(chunk)
                if row.finished:
                    self._finish(task)

    def _batch_step(self) -> list:
        """One step of the batch; on the speculative batch, each row drafts or not as the policy says."""
        if not self.spec_batch:
            rows, t0 = len(self.batched.rows), time.perf_counter()
            out = self.batched.step()
            self._count_step(False, time.perf_counter() - t0, len(out), rows)
            return out
        rows_before = len(self.batched.rows)
        size = bucket(rows_before)
        # a batch of greedy rows drafts the greedy plan; one sampled row makes every row draft the sampled plan
        greedy = self._greedy_batch = all(r.greedy for r in self.batched.rows)
        mode = self._choose(rows_before, greedy)
        drafting = self.tree_at(size, greedy) if mode else False  # the tree rows draft this step (False: AR)
        t0 = time.perf_counter()
        out = self.batched.step(drafting)
        tokens = sum(len(chunk) for _, chunk in out)
        self._count_step(bool(drafting), time.perf_counter() - t0, tokens, rows_before)
        catching_up = self._ar_rows_before and bool(drafting)
        if tokens and not catching_up:  # a pure step measures its mode
            self._pure = (drafting, rows_before, tokens, greedy)  # _cycle measures it
        self._ar_rows_before = not drafting
        counts = self.step_counts.setdefault(size, [0, 0])
        counts[0] += 1
        counts[1] += bool(drafting)
        self._steps += 1
        if self._steps % LOG_EVERY == 0 and self.speculation == "auto":
            log.info("adaptive speculation, %d steps: %s", self._steps, self._policy_line())
        return out

    def _count_step(self, drafted: bool, seconds: float, tokens: int, rows: int) -> None:
        """The batch-step counters of /metrics (every step, pure or not: what the server did, not the model)."""
        if self.metrics is not None:
            self.metrics.observe_step("draft" if drafted else "ar", seconds, tokens, bucket(rows))

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

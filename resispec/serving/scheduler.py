"""Continuous batching (DESIGN.md "Batched decoding and scheduling"): one thread owns the models and serves every
request, admitting waiting ones and retiring finished or cancelled ones at step boundaries.

Paths a request can take:
  batch   a row of the engine's batched decoder: `BatchedSpeculativeDecoder` when the engine is speculative (per-row
          draft trees, one draft forward per depth and ONE target forward per step for every row), `BatchedDecoder`
          (batched autoregressive) otherwise.
  stream  an engine without a batched decoder (or max_batch_size = 1): one request at a time, the old behaviour.

Speculation adapts to load (`server.speculation`: auto | always | never), step by step: the batched speculative
decoder can take a plain autoregressive step for any row (`step(draft=flags)`) and stay exact. Under `auto` the
scheduler compares the two modes in PAIRS: two adjacent steps, one of each mode, whose row counts differ by at most
one (one admission per step boundary; while the batch fills or drains, equal counts are rare), give one ratio
of seconds per emitted token (drafting / autoregressive); per batch-size bucket (powers of two) it drafts while the
median of the last COST_WINDOW ratios is below 1. Until a bucket has a ratio, the nearest bucket's ratio decides,
and before any, the planner's plan (drafting unless it planned none there). To measure, the preferred mode is
left for PROBE_STEPS steps, every 4th step until the bucket's first ratio and every EXPLORE_EVERY-th step after.
A drafting step right after autoregressive ones also feeds the draft the tokens it skipped, so it is never paired. (Costs of the two modes measured at different
moments were compared before: a batch of 9 rows and one of 16 share a bucket, and the mode measured with more rows
looked cheaper per token. Measured against that design at T = 1, 8 and 16 clients: no difference beyond the
machine's noise, recipes/vllm/README.md.)
`cost_table()` shows the per-mode medians and the ratio. Seeded sampled rows always draft (unless `never`), so a
seeded request's tokens never depend on its neighbours or on the load.

Bounds: at most `max_batch_size` running requests; with `kv_budget` (tokens), a request is admitted only while
(running + 1) x the longest worst-case row fits (prompt + max_tokens; on the speculative batch with room for the
holes rejected tree nodes leave until a repack), so the cache can never outgrow it; a request that alone exceeds it
is refused (RequestTooLargeError -> 400). A newcomer's prefill runs alone between two steps, and at most one per
step boundary while others run, so running streams stall for at most one prefill.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple

from resispec.serving.logprobs import start_scoring

log = logging.getLogger(__name__)

EXPLORE_EVERY = 64  # every so many steps at a batch size, the other mode is measured again
PROBE_STEPS = 2  # steps of the other mode per measurement (the first drafting one pays the draft's catch-up)
COST_WINDOW = 32  # recent per-token costs (per mode) and spec/AR ratios kept per batch-size bucket
SPECULATION = ("auto", "always", "never")  # lone requests: by measured cost, always speculative, never


class QueueFullError(RuntimeError):
    """Too many requests waiting (503, retry later)."""


class RequestTooLargeError(ValueError):
    """The request's prompt + max_tokens can never fit in the KV budget (400)."""


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


class _Step(NamedTuple):
    """A pure batch step, as the adaptive policy pairs them."""

    mode: str  # "spec" | "ar"
    rows: int
    cost: float  # seconds per emitted token
    index: int  # the scheduler's step count when it ran
    after_ar: bool  # a drafting step right after AR steps (it also fed the draft what it skipped)


def _bucket(size: int) -> int:
    """Batch sizes share cost measurements by power-of-two bucket (1, 2, 3-4, 5-8, ...): the bucket's top size."""
    return 1 << max(0, size - 1).bit_length()


def _seeded(params) -> bool:
    """A seeded sampled request: it always drafts, so its tokens never depend on the load."""
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
        self.spec_batch = self.batched is not None and getattr(self.batched, "draft", None) is not None
        # batch-size bucket -> planned tree, None = do not speculate (decode.tree=auto); empty = the engine's tree
        self.trees_by_batch = getattr(engine, "trees_by_batch", None) or {}
        self.samples: dict[tuple[str, int], deque] = {}  # (mode, batch size) -> seconds per token
        self.ratios: dict[int, deque] = {}  # batch size -> paired drafting / AR seconds per token
        self.steps_at: dict[int, int] = {}  # batch size -> steps taken
        self._probing: dict[int, int] = {}  # batch size -> steps of the other mode still to take
        self._steps = 0  # batch steps taken
        self._prev: _Step | None = None  # the last pure step
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

    def _columns(self, job) -> int:
        """Most cache columns the job's row can need: prompt + max_tokens; on the speculative batch, rejected tree
        nodes leave holes until the cache is repacked (at 2 x the longest row + 16), plus one step's tree."""
        n = len(job.prompt_ids) + job.params.max_new_tokens
        return 2 * n + 17 + self.batched.max_nodes if self.spec_batch else n

    def _fits(self, job) -> bool:
        if len(self.tasks) >= self.max_batch_size:
            return False
        if self.kv_budget is None:
            return True
        longest = max(self._columns(j) for j in [t.job for t in self.tasks] + [job])
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
                job = self.waiting.popleft()
                self._gauges()
            self._start(job)
            if busy:
                return

    def _start(self, job) -> None:
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

    def _add_row(self, task: _Task):
        """Prefill `task` as a batch row."""
        p = task.job.params
        return self.batched.add(
            list(task.job.prompt_ids),
            max_new_tokens=p.max_new_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            eos_token_id=self.engine.eos(p),
            stop=p.stop or None,
            generator=task.generator,
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
            out = self._batch_step(rows)
            for row, chunk in out:
                task = rows[id(row)]
                task.emit(chunk)
                if row.finished:
                    self._finish(task)

    def _batch_step(self, rows: dict) -> list:
        """One step of the batch; on the speculative batch, each row drafts or not as the policy says."""
        if not self.spec_batch:
            return self.batched.step()
        size = _bucket(len(self.batched.rows))
        mode = self._choose(size)
        drafting = self.tree_at(size) if mode else False  # the tree rows draft this step (False: AR step)
        # seeded sampled rows always draft the engine's own tree: their tokens never depend on the load
        flags = [
            True if self.speculation != "never" and _seeded(rows[id(r)].job.params) else drafting
            for r in self.batched.rows
        ]
        rows_before = len(self.batched.rows)
        t0 = time.perf_counter()
        out = self.batched.step(flags)
        tokens = sum(len(chunk) for _, chunk in out)
        pure = bool(tokens) and all(f is drafting for f in flags)
        if pure:  # a pure step measures its mode
            self._measure(("spec" if mode else "ar", size), (time.perf_counter() - t0) / tokens, rows_before)
        else:
            self._prev = None
        self._steps += 1
        return out

    def tree_at(self, size: int):
        """The tree speculative steps draft at this batch-size bucket: the planner's tree for the bucket when the
        engine was planned per batch size (`trees_by_batch`, decode.tree=auto), else True (the engine's tree).
        Where the plan says not to speculate, exploring steps draft the engine's tree."""
        planned = self.trees_by_batch.get(size)
        return tuple(planned) if planned else True

    def _plan_prefers_ar(self, size: int) -> bool:
        return size in self.trees_by_batch and not self.trees_by_batch[size]

    def _choose(self, size: int) -> bool:
        """Draft this step? The adaptive policy (module docstring)."""
        if self.speculation != "auto":
            return self.speculation == "always"
        steps = self.steps_at[size] = self.steps_at.get(size, 0) + 1
        ratio, near = self.ratio(size), self._nearest_ratio(size)
        if ratio is not None:
            preferred = ratio < 1.0
        elif near is not None:  # the closest measured batch size says more than the plan
            preferred = near < 1.0
        else:
            preferred = not self._plan_prefers_ar(size)
        left = self._probing.get(size, 0)
        if left:
            self._probing[size] = left - 1
            return not preferred
        if steps % (EXPLORE_EVERY if ratio is not None else 4) == 1:  # the other mode, from the next step
            self._probing[size] = PROBE_STEPS
        return preferred

    def _measure(self, key: tuple[str, int], seconds_per_token: float, rows: int) -> None:
        """Record a pure step's cost, and a ratio when it pairs with the step just before (module docstring)."""
        self.samples.setdefault(key, deque(maxlen=COST_WINDOW)).append(seconds_per_token)
        mode, size = key
        prev = self._prev
        after_ar = mode == "spec" and prev is not None and prev.mode == "ar"
        if (
            prev is not None
            and prev.index == self._steps - 1
            and _bucket(prev.rows) == _bucket(rows)
            and abs(prev.rows - rows) <= 1
            and prev.mode != mode
            and not after_ar
            and not prev.after_ar
        ):
            spec, ar = (seconds_per_token, prev.cost) if mode == "spec" else (prev.cost, seconds_per_token)
            self.ratios.setdefault(size, deque(maxlen=COST_WINDOW)).append(spec / ar)
        self._prev = _Step(mode, rows, seconds_per_token, self._steps, after_ar)

    def _nearest_ratio(self, size: int) -> float | None:
        """The ratio of the measured bucket closest to `size` (in powers of two; the larger on a tie)."""
        measured = [b for b in self.ratios if self.ratios[b]]
        if not measured:
            return None
        return self.ratio(min(measured, key=lambda b: (abs(b.bit_length() - size.bit_length()), -b)))

    def ratio(self, size: int) -> float | None:
        """Median paired drafting / AR cost per token at this batch-size bucket; None before the first pair."""
        ratios = sorted(self.ratios.get(size, ()))
        return ratios[len(ratios) // 2] if ratios else None

    def cost(self, key: tuple[str, int]) -> float | None:
        """Median seconds per emitted token of (mode "spec" | "ar", batch size) over its recent steps; None before
        the first measurement."""
        samples = sorted(self.samples.get(key, ()))
        return samples[len(samples) // 2] if samples else None

    def cost_table(self) -> dict[int, dict[str, float | None]]:
        """Batch size bucket -> measured seconds per token of drafting and autoregressive steps (where speculation
        pays)."""
        sizes = sorted({size for _, size in self.samples})
        return {
            b: {
                "spec": self.cost(("spec", b)),
                "ar": self.cost(("ar", b)),
                "ratio": self.ratio(b),
                "tree": self._tree_label(b),
            }
            for b in sizes
        }

    def _tree_label(self, size: int) -> list[int]:
        tree = self.tree_at(size)
        return list(self.batched.shape) if tree is True else list(tree)

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

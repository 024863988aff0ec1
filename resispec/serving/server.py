"""Load the model pair, build the decoder and run the app with uvicorn (what `serve/server.py` calls)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from resispec.data.config import DataConfig
from resispec.data.prompts import load_heldout_prompts
from resispec.decoding import SpeculativeDecoder
from resispec.decoding.config import DecodeConfig
from resispec.decoding.fast_forward import fast_forward
from resispec.decoding.planner import Planner
from resispec.errors import UserError
from resispec.models import load_pair
from resispec.models.config import ModelConfig, WorldConfig
from resispec.sampling import is_greedy
from resispec.serving.app import create_app
from resispec.serving.config import ServerConfig
from resispec.serving.worker import DecoderEngine
from resispec.verify import build_rule

log = logging.getLogger(__name__)

# `decode.rule` values that serve the target alone (plain autoregressive decoding, the baseline)
AR_RULES = ("ar", "none")


def serving_threads(server: ServerConfig, spare_core: bool = False) -> int:
    """Set torch's intra-op threads for serving (`server.num_threads`, else all cores, or all but one with
    `spare_core`) -> the count. Measured on 2 cores, tiny world, 8 clients (docs/journal/vllm.md): on the HF
    forward the decode step's second thread waited on the event loop (1 thread was faster); on the decoder's own
    forward, whose step holds the interpreter far less, 2 threads gave 322 tok/s against 246 with 1."""
    import os

    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = server.num_threads or max(1, cores - int(spare_core))
    torch.set_num_threads(threads)
    return threads


def threads_by_rows(server: ServerConfig, threads: int) -> Callable[[int], int]:
    """The torch threads a step of `rows` requests runs on: `threads`, one fewer while fewer than
    server.spare_core_below requests run (a small batch's forward gains little from the last core, and the HTTP
    frontend and the clients on it no longer stall the forward's threads)."""

    def at(rows: int) -> int:
        return max(1, threads - 1) if rows < server.spare_core_below else threads

    return at


def off_main_thread(fn, *args, **kwargs):
    """fn(*args, **kwargs) run in a short-lived thread; its result, or its exception re-raised.

    The server's model work before serving (loading, the decoder's forward, the planner's timings and
    calibration) runs here, never on the main thread: with libgomp, once the main thread has run parallel torch
    work, its OpenMP team outlives it, and threads started later (the decode thread) ran 1.5-2.5x slower on this
    2-core machine. More OpenMP threads than cores make libgomp's idle threads sleep at once instead of spinning,
    so each of a step's hundreds of small parallel regions waits for a wake-up: the decode thread's 8-row AR step
    went from 10.4 to 15-16 ms at 1.2-1.3 cores busy instead of 2. Work done in a thread that has exited leaves no
    such trace (its team goes with it). Measured with torch 2.13 (CPU wheel): a 2.5x slower planner on the main
    thread (the server fell from 413 to 184 tok/s at 8 clients), and the fast forward's weight packing on the main
    thread (batched AR at 8 clients: 513 against 639 tok/s, 1.83 against 1.30 ms per token).
    `tests/unit/test_serving.py` checks the plumbing."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="resispec-setup"
    ) as pool:  # its thread exits on leaving
        return pool.submit(fn, *args, **kwargs).result()


def context_length(target, draft, server: ServerConfig) -> int:
    """The server's context length: `server.max_model_len`, else the smaller max_position_embeddings."""
    if server.max_model_len is not None:
        return server.max_model_len
    lengths = [getattr(m.config, "max_position_embeddings", None) for m in (target, draft)]
    lengths = [n for n in lengths if n]
    return min(lengths) if lengths else 2048


def batch_buckets(max_batch_size: int) -> list[int]:
    """The batch-size buckets the scheduler keeps costs for (powers of two up to max_batch_size's bucket)."""
    sizes, b = [1], 1
    while b < max_batch_size:
        b *= 2
        sizes.append(b)
    return sizes


def planned_trees(
    target, draft, decode: DecodeConfig, prompts: list[list[int]], batch_sizes=(1,), threads_at=None
) -> tuple[dict[int, list[int] | None], dict[int, list[int] | None]]:
    """decode.tree=auto: the planner's trees for decode.rule on this device and pair, calibrated on `prompts`
    (held-out prompt ids), for each batch size -> (sampled rows' plan, greedy rows' plan), each {size: tree, or
    None where the planner predicts that speculation does not pay}; batch size 1 always gets a tree (the engine's
    own). Sampled rows are planned at decode's sampling settings (temperature 1 where decode's is 0), greedy rows
    at temperature 0: greedy acceptance is higher, and one plan for both served T = 0 requests trees planned at
    T = 1 (a chain of 3 or [2, 1, 1] where [3] measured 1.3x AR at one client). Logs each choice with its predicted
    tau and speedup. `threads_at` (rows -> torch threads, threads_by_rows): each size is timed on the threads it
    will decode on."""
    if not prompts:
        raise UserError(
            "decode.tree=auto needs calibration prompts (decode.plan_prompts > 0 and a data source)"
        )
    planner = Planner(target, prompts)
    sizes = sorted(set(batch_sizes) | {1})
    sampled_t = 1.0 if is_greedy(decode.temperature) else decode.temperature
    out = []
    for temperature in (sampled_t, 0.0):
        sampling = {"temperature": temperature, "top_k": decode.top_k, "top_p": decode.top_p}
        plans = planner.choose_by_batch(draft, decode.rule, sampling, sizes, decode.auto_policy, threads_at)
        trees = {}
        for b, plan in plans.items():
            pays = plan.speedup > 1.0 or b == 1
            trees[b] = plan.tree if pays else None
            msg = f"tree=auto ({decode.rule}, T={temperature:g}, batch {b}): {plan.describe()}" + (
                "" if pays else " -> no speculation at this batch size"
            )
            log.info(msg)
            print(msg, flush=True)
        out.append(trees)
    return out[0], out[1]


def build_engine(
    target,
    draft,
    tokenizer,
    decode: DecodeConfig,
    server: ServerConfig | None = None,
    plan_prompts: list[list[int]] | None = None,
    plans: tuple[dict, dict] | None = None,
    threads: int | None = None,
):
    """A DecoderEngine for the loaded pair under the `decode` settings (rule `ar` serves the target alone);
    `server` sets continuous batching (max_batch_size, kv_budget_tokens, speculation). decode.tree=auto plans the
    trees per batch-size bucket first (planned_trees: sampled and greedy rows), calibrated on `plan_prompts`,
    unless `plans` brings them; the engine's own tree is the batch-1 tree of decode's temperature. `threads`: the
    torch threads serving runs on (serving_threads); with it, the scheduler and the planner use one fewer for small
    batches (threads_by_rows)."""

    server = server or ServerConfig(max_batch_size=1)
    speculative = decode.rule not in AR_RULES
    threads_at = threads_by_rows(server, threads) if threads else None
    sampled = greedy = None
    if not speculative:
        tree = [1]
    elif decode.planned:
        if plans is None:
            sizes = batch_buckets(server.max_batch_size)
            plans = planned_trees(target, draft, decode, plan_prompts or [], sizes, threads_at)
        sampled, greedy = plans
        tree = (greedy if is_greedy(decode.temperature) else sampled)[1]
    else:
        tree = decode.tree
    decoder = SpeculativeDecoder(
        target,
        draft,
        rule=build_rule(decode.rule, decode.auto_policy)
        if speculative
        else "chain",  # AR never calls the rule
        tree=tree,
        tokenizer=tokenizer,
        compile=decode.compile,
        fast_forward=decode.fast_forward,
    )
    return DecoderEngine(
        decoder,
        tokenizer,
        speculative=speculative,
        max_batch_size=server.max_batch_size,
        kv_budget=server.kv_budget_tokens,
        max_prefill_tokens=server.max_prefill_tokens,
        prefill_chunk_tokens=server.prefill_chunk_tokens,
        prefix_cache_tokens=server.prefix_cache_tokens,
        speculation=server.speculation,
        seeded_sampling=server.seeded_sampling,
        trees_by_batch=sampled,
        greedy_trees_by_batch=greedy,
        threads_at=threads_at,
    )


def build_app(
    server: ServerConfig,
    decode: DecodeConfig,
    target_cfg: ModelConfig,
    draft_cfg: ModelConfig,
    world: WorldConfig | None = None,
    data: DataConfig | None = None,
):
    """Load the pair named by the configs and return the FastAPI app serving it. `data`: where decode.tree=auto
    takes its calibration prompts (the eval split). Every piece of model work here (loading, or building the
    embedded world; the decoder's forward, whose construction concatenates and packs weights; the planner) runs
    off the main thread (off_main_thread)."""

    def load():
        target, draft, tokenizer = load_pair(target_cfg, draft_cfg, world)
        return target, draft, tokenizer, decode.fast_forward and fast_forward(target) is not target

    target, draft, tokenizer, own_forward = off_main_thread(load)
    threads = serving_threads(server, spare_core=not own_forward)
    prompts = None
    if decode.planned and decode.rule not in AR_RULES and data is not None and decode.plan_prompts > 0:
        prompts = load_heldout_prompts(data, tokenizer, world, decode.plan_prompts, split="eval")
    engine = off_main_thread(
        build_engine, target, draft, tokenizer, decode, server, plan_prompts=prompts, threads=threads
    )
    max_len = context_length(target, draft, server)
    log.info(
        "serving %s (target %s, draft %s) rule=%s tree=%s, context %d, max batch %d, %d torch threads",
        server.model_name,
        target_cfg.path,
        draft_cfg.path,
        decode.rule,
        engine.decoder.shape,
        max_len,
        server.max_batch_size,
        threads,
    )
    template_kwargs = data.chat_template_kwargs if data is not None else None
    return create_app(
        engine, tokenizer, server, decode, max_model_len=max_len, chat_template_kwargs=template_kwargs
    )


def serve(
    server: ServerConfig,
    decode: DecodeConfig,
    target_cfg: ModelConfig,
    draft_cfg: ModelConfig,
    world: WorldConfig | None = None,
    data: DataConfig | None = None,
) -> None:
    """Build the app and serve it until interrupted."""
    import uvicorn

    app = build_app(server, decode, target_cfg, draft_cfg, world, data)
    # one worker process: the decoding worker thread owns the models
    uvicorn.run(app, host=server.host, port=server.port, log_level=server.log_level, workers=1)

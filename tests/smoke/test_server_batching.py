"""Continuous batching end to end on the micro world: the app in-process (uvicorn in a thread), real HTTP.

Concurrent requests decode together and each gets exactly what it would get alone; a seeded request ignores its
neighbours; the KV budget bounds the batch (too large -> 400); a client that hangs up leaves the batch; the adaptive
policy measures drafting and autoregressive steps; the load sweep completes every request; a storm of mixed requests
(chunked prefill, stop strings, seeds, hang-ups) gets what each gets alone."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import torch

from resispec.benchmark.config import BenchConfig
from resispec.benchmark.inprocess import compare_in_process, serve_in_thread, serving_modes
from resispec.benchmark.load import run_load_sweep, run_load_test
from resispec.decoding import SpeculativeDecoder
from resispec.decoding.config import DecodeConfig
from resispec.decoding.tree import max_tree_nodes
from resispec.models import load_pair
from resispec.models.config import ModelConfig
from resispec.serving.app import create_app
from resispec.serving.config import ServerConfig
from resispec.serving.server import build_engine
from resispec.serving.text import decode_ids, encode_text

PROMPTS = ["def main():\n", "import os\n", "class Foo:\n    def ", "for i in range(", "return self.", "x = ["]


@pytest.fixture(scope="module")
def pair(micro_world):
    _, paths = micro_world
    return load_pair(ModelConfig(path=str(paths.target_dir)), ModelConfig(path=str(paths.draft_dir)))


@pytest.fixture(scope="module")
def serve(pair):
    """Factory: ServerConfig overrides -> (base URL, scheduler); every server is stopped at the end."""

    target, draft, tok = pair
    servers = []

    def start(trees_by_batch=None, **overrides):
        server = ServerConfig(model_name="m", **overrides)
        decode = DecodeConfig(rule="resispec", tree=[2, 1])
        engine = build_engine(target, draft, tok, decode, server)
        engine.trees_by_batch = trees_by_batch  # what decode.tree=auto plans (tests/smoke/test_tree_auto.py)
        app = create_app(engine, tok, server, decode, max_model_len=256)
        url, uv, thread = serve_in_thread(app, log_level="error")
        servers.append((uv, thread))
        return url, app.state.server.worker.scheduler

    yield start
    for uv, thread in servers:
        uv.should_exit = True
        thread.join(10)


def _complete_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))

    return asyncio.run(main())


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def _greedy_alone(pair, prompt: str, n: int) -> str:
    target, draft, tok = pair
    ids = encode_text(tok, prompt)
    out = SpeculativeDecoder(target, draft, tokenizer=tok).generate_autoregressive(
        torch.tensor([ids]), max_new_tokens=n, temperature=0.0, eos_token_id=[]
    )
    return decode_ids(tok, out.sequences[0, len(ids) :].tolist())


def _assert_greedy_as_alone(url: str, pair, prompts: list[str], max_tokens: int) -> None:
    """Concurrent greedy requests: each text equals the target's greedy decoding of its prompt alone."""
    bodies = [
        {"model": "m", "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        for p in prompts
    ]
    for r, body in zip(_complete_all(url, bodies), bodies, strict=True):
        assert r.json()["choices"][0]["text"] == _greedy_alone(pair, body["prompt"], max_tokens)


def test_concurrent_greedy_requests_decode_together_and_equal_alone(serve, pair, one_thread):
    url, sched = serve(max_batch_size=4, speculation="always")
    bodies = [
        {"model": "m", "prompt": p, "max_tokens": 10 + 2 * i, "temperature": 0, "ignore_eos": True}
        for i, p in enumerate(PROMPTS)
    ]
    responses = _complete_all(url, bodies)
    for body, r in zip(bodies, responses, strict=True):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert r.json()["usage"]["completion_tokens"] == body["max_tokens"]
        assert choice["text"] == _greedy_alone(pair, body["prompt"], body["max_tokens"])
    assert 1 < sched.peak_running <= 4  # decoded together, never more than max_batch_size
    m = httpx.get(url + "/metrics").text
    assert _metric(m, "resispec:num_requests_running") == 0
    assert _metric(m, "resispec:num_requests_waiting") == 0


def test_adaptive_speculation_measures_both_modes(serve, pair, one_thread):
    url, sched = serve(max_batch_size=4, speculation="auto")
    _assert_greedy_as_alone(url, pair, PROMPTS[:3], 40)
    table = sched.cost_table()
    assert any(c["spec"] is not None and c["ar"] is not None for c in table.values()), table


def test_trees_by_batch_size_drive_the_speculative_steps(serve, pair, one_thread):
    """The planner's per-batch-size trees: batch 1 drafts [3, 1, 1], batches of 2 take AR first (the plan says
    speculation does not pay there) and explore a one-token chain, batches of 3-4 draft a chain of 2; every
    output is still the target's greedy one."""
    plan = {1: [3, 1, 1], 2: None, 4: [1, 1]}
    url, sched = serve(trees_by_batch=plan, max_batch_size=4, speculation="auto")
    assert sched.tree_at(1) == (3, 1, 1) and sched.tree_at(2) == (1,) and sched.tree_at(4) == (1, 1)
    assert sched._choose(2) is False and sched._choose(4) is True  # unmeasured: the plan decides first
    _assert_greedy_as_alone(url, pair, PROMPTS[:4], 30)
    table = sched.cost_table()
    assert table[4]["tree"] == [1, 1] and table[4]["spec"] is not None, table


def test_seeded_request_ignores_its_neighbours(serve, one_thread):
    url, sched = serve(max_batch_size=8, speculation="never")
    body = {
        "model": "m",
        "prompt": PROMPTS[2],
        "max_tokens": 24,
        "temperature": 1.0,
        "seed": 5,
        "ignore_eos": True,
    }
    alone = _complete_all(url, [body])[0].json()["choices"][0]["text"]
    neighbours = [
        {"model": "m", "prompt": p, "max_tokens": 6 + i, "temperature": 0.8 * (i % 2), "seed": i}
        for i, p in enumerate(PROMPTS)
    ]
    crowd = _complete_all(url, neighbours[:3] + [body] + neighbours[3:])
    assert crowd[3].json()["choices"][0]["text"] == alone
    assert sched.peak_running > 1
    # a seeded request's tokens do not depend on the mode either: the speculative server, alone and in a crowd
    # where the adaptive policy switches speculation by load, emits the same text
    for speculation in ("always", "auto"):
        url, sched = serve(max_batch_size=8, speculation=speculation)
        assert _complete_all(url, [body])[0].json()["choices"][0]["text"] == alone
        crowd = _complete_all(url, neighbours[:3] + [body] + neighbours[3:])
        assert crowd[3].json()["choices"][0]["text"] == alone
    # seeded_sampling=rule: the configured rule with a seeded stream (reproducible, but the tokens depend on the
    # steps that drafted); a value that is neither is refused
    url, _ = serve(max_batch_size=8, speculation="always", seeded_sampling="rule")
    first, again = (_complete_all(url, [body])[0].json()["choices"][0]["text"] for _ in range(2))
    assert first == again != alone
    with pytest.raises(ValueError, match="seeded_sampling"):
        serve(seeded_sampling="fixed")


def test_kv_budget_bounds_the_batch(serve, pair, one_thread):
    tok = pair[2]
    need = max(len(encode_text(tok, p)) for p in PROMPTS[:4]) + 12
    cols = 2 * need + 17 + max_tree_nodes([2, 1])  # a speculative row's worst case (holes before a repack)
    url, sched = serve(max_batch_size=8, kv_budget_tokens=2 * cols)
    too_big = {"model": "m", "prompt": PROMPTS[0], "max_tokens": 2 * cols, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=too_big)
    assert r.status_code == 400 and r.json()["error"]["code"] == "kv_budget_exceeded"
    bodies = [{"model": "m", "prompt": p, "max_tokens": 12, "ignore_eos": True} for p in PROMPTS[:4]]
    responses = _complete_all(url, bodies)
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12 for r in responses)
    assert sched.peak_running == 2  # the other two waited for room


def test_disconnect_leaves_the_batch(serve, one_thread):
    url, sched = serve(max_batch_size=4, speculation="never")
    keep = {"model": "m", "prompt": PROMPTS[1], "max_tokens": 40, "ignore_eos": True}
    gone = {"model": "m", "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "stream": True}

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            kept = asyncio.create_task(client.post("/v1/completions", json=keep))
            async with client.stream("POST", "/v1/completions", json=gone) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                        break  # hang up after the first text
            return await kept

    kept = asyncio.run(main())
    assert kept.status_code == 200 and kept.json()["usage"]["completion_tokens"] == 40
    deadline = time.time() + 10
    while sched.num_running and time.time() < deadline:
        time.sleep(0.05)
    assert sched.num_running == 0 and sched.batched.kv_tokens == 0


def test_load_sweep_completes_every_request(serve, micro_world, tmp_path, one_thread):
    url, _ = serve(max_batch_size=4)
    bench = BenchConfig(concurrencies=[1, 2, 4], num_requests=4, max_new_tokens=8, temperatures=[1.0])
    results = run_load_sweep(url, PROMPTS, bench, model="m", output_dir=tmp_path, show=False)
    assert [r.concurrency for r in results] == [1, 2, 4]
    for r in results:
        assert r.num_ok == r.num_requests and r.num_failed == 0 and r.num_short == 0
        assert r.completion_tokens == r.num_requests * 8
        assert r.latency_p50 <= r.latency_p95
    assert (tmp_path / "sweep.md").exists() and (tmp_path / "sweep.png").stat().st_size > 0
    assert "drafted" in (tmp_path / "sweep.md").read_text()


@pytest.mark.parametrize("speculation", ["always", "never"])
def test_load_test_reads_the_servers_batch_steps(serve, speculation, one_thread):
    """/metrics counts the batch steps by mode with their seconds and tokens; the load test reports the share
    that drafted and each mode's ms per token, and the tokens the steps emitted are the completions'."""

    url, _ = serve(max_batch_size=4, speculation=speculation)
    bench = BenchConfig(concurrency=3, num_requests=3, max_new_tokens=10, temperatures=[1.0])
    res = run_load_test(url, PROMPTS, bench, model="m", show=False)
    assert res.num_ok == 3
    assert sum(c[2] for c in res.steps.values()) == res.completion_tokens == 30
    if speculation == "always":
        assert res.drafted_share == 1.0 and res.draft_ms_per_token > 0 and res.ar_ms_per_token is None
    else:
        assert res.drafted_share == 0.0 and res.ar_ms_per_token > 0 and res.draft_ms_per_token is None


def test_in_process_comparison(pair, tmp_path, one_thread):
    target, draft, tok = pair
    modes = {k: v for k, v in serving_modes(4).items() if k in ("one-at-a-time AR", "batched adaptive")}
    # two interleaved rounds, merged per (mode, level)
    bench = BenchConfig(concurrencies=[2], num_requests=2, max_new_tokens=6, temperatures=[0.0], rounds=2)
    decode = DecodeConfig(rule="resispec", tree=[2, 1])
    results = compare_in_process(
        target, draft, tok, decode, PROMPTS, bench, modes, max_model_len=256, output_dir=tmp_path, show=False
    )
    assert [r.label for r in results] == list(modes)
    assert all(r.num_ok == 4 and r.num_short == 0 and r.completion_tokens == 24 for r in results)
    assert "batch size" in (tmp_path / "sweep.md").read_text()


def test_prefix_cache_reuses_prompts_and_says_so(serve, pair, one_thread):
    """A prompt seen before is not prefilled again: the OpenAI client reads usage.prompt_tokens_details.cached_tokens,
    /metrics counts the lookups and hits as vLLM does, and the text is the target's greedy text either way; with
    server.prefix_cache_tokens=0 nothing is cached."""
    import openai

    target, draft, tok = pair
    system = (
        "You are a careful assistant. Answer briefly and exactly.\n" * 3
    )  # a shared header of several blocks
    prompts = [system + "def main():\n", system + "import os\n"]
    for cache_tokens in (4096, 0):
        url, _ = serve(max_batch_size=4, speculation="always", prefix_cache_tokens=cache_tokens)
        oai = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        cached = []
        for p in [prompts[0], prompts[0], prompts[1]]:
            c = oai.completions.create(
                model="m", prompt=p, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
            )
            assert c.choices[0].text == _greedy_alone(pair, p, 8)
            details = c.usage.prompt_tokens_details
            cached.append(0 if details is None else details.cached_tokens)
        n0, n1 = (len(encode_text(tok, p)) for p in prompts)
        m = httpx.get(url + "/metrics").text
        if cache_tokens:
            shared = len(encode_text(tok, system)) // 16 * 16  # the header's whole 16-token blocks, at most
            assert cached[0] == 0 and cached[1] == n0 - 1 and 0 < cached[2] <= shared
            assert _metric(m, "resispec:prefix_cache_queries_total") == n0 - 1 + n0 - 1 + n1 - 1
            assert _metric(m, "resispec:prefix_cache_hits_total") == sum(cached)
        else:
            assert cached == [0, 0, 0] and _metric(m, "resispec:prefix_cache_hits_total") == 0


def test_a_storm_of_mixed_requests_gets_what_each_gets_alone(serve, one_thread):
    """Greedy and seeded requests, short prompts and prompts prefilled in parts (chunked prefill at 8 tokens),
    with and without stop strings, each sent alone, then all at once twice over beside streams that hang up after
    their first text: every request gets the text it got alone, and nothing is left running."""
    import random

    url, sched = serve(max_batch_size=4, speculation="auto", prefill_chunk_tokens=8, prefix_cache_tokens=0)
    rng = random.Random(0)
    longs = ["".join(PROMPTS[i:] + PROMPTS[:i]) * 2 for i in range(3)]  # ~150 characters: prefilled in parts
    bodies = []
    for i, prompt in enumerate(PROMPTS + longs):
        body = {"model": "m", "prompt": prompt, "max_tokens": rng.choice([1, 7, 16, 25]), "ignore_eos": True}
        body.update({"temperature": 0.0} if i % 2 else {"temperature": 0.9, "seed": i, "top_p": 0.95})
        if i % 3 == 0:
            body.update(stop=["\n", " ("], ignore_eos=False)
        bodies.append(body)
    alone = [_complete_all(url, [b])[0].json()["choices"][0] for b in bodies]
    assert {c["finish_reason"] for c in alone} == {"stop", "length"}
    parts = []  # prompt lengths of the prefills done in parts (while others ran)
    prefill_part = sched._prefill_part
    sched._prefill_part = lambda job: (parts.append(len(job.prompt_ids)), prefill_part(job))[1]
    decoy = {"model": "m", "max_tokens": 100, "temperature": 1.0, "stream": True, "ignore_eos": True}

    async def hang_up(prompt: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            async with client.stream("POST", "/v1/completions", json=dict(decoy, prompt=prompt)) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                        return  # hang up after the first text

    async def storm():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            jobs = [(b, client.post("/v1/completions", json=b)) for b in bodies * 2]
            rng.shuffle(jobs)
            order = [b for b, _ in jobs]
            got = await asyncio.gather(*(job for _, job in jobs), *(hang_up(p) for p in longs))
            return order, got[: len(jobs)]

    order, responses = asyncio.run(storm())
    for body, r in zip(order, responses, strict=True):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        want = alone[bodies.index(body)]
        assert (choice["text"], choice["finish_reason"]) == (want["text"], want["finish_reason"]), body
    assert sched.peak_running == 4 and parts and min(parts) > 8
    deadline = time.time() + 10
    while sched.num_running and time.time() < deadline:
        time.sleep(0.05)
    assert sched.num_running == 0 and sched.num_waiting == 0 and sched.batched.kv_tokens == 0

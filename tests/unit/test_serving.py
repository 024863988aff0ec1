"""Serving without models: text assembly, the HTTP layer over a fake engine (uvicorn in a thread), worker queueing
and cancellation, report writing, the load test's guards."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

import resispec.serving.server as srv
from resispec.benchmark.config import BenchConfig
from resispec.benchmark.inprocess import UnknownModeError, select_modes, serve_in_thread, serving_modes
from resispec.benchmark.load import (
    LoadTestError,
    one_request,
    parse_servers,
    request_max_tokens,
    run_interleaved,
    run_load_test,
    scrape_metrics,
    step_counts,
)
from resispec.benchmark.report import comparison_table, write_report
from resispec.benchmark.results import BenchRow, LoadTestResult, merge_rounds, percentile, sum_stats
from resispec.config import register_configs, to_typed
from resispec.decoding import DecodeStats
from resispec.decoding.config import DecodeConfig
from resispec.models.config import ModelConfig
from resispec.sampling import probs as process_logits
from resispec.sampling import sample_tokens
from resispec.serving.app import create_app
from resispec.serving.config import ServerConfig
from resispec.serving.metrics import ServerMetrics
from resispec.serving.policy import EXPLORE_EVERY, MIN_SAMPLES, PROBE_STEPS, StepCostModel, bucket
from resispec.serving.scheduler import Outbox, Scheduler
from resispec.serving.server import off_main_thread, serving_threads, threads_by_rows
from resispec.serving.text import TextAssembler, encode_chat, fallback_chat_prompt

ALPHABET = "abcdefghij \n"


class CharTokenizer:
    """Token i <-> ALPHABET[i]; id 12 is EOS (rendered as nothing), ids >= 13 render as U+FFFD until followed by
    another token, like an incomplete byte-level BPE character."""

    eos_token_id = 12
    chat_template = None

    def __len__(self) -> int:
        return 16

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [ALPHABET.index(c) for c in text if c in ALPHABET]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out = []
        for i, t in enumerate(ids):
            if t < len(ALPHABET):
                out.append(ALPHABET[t])
            elif t >= 13:
                out.append("\ufffd" if i == len(ids) - 1 else "é")
        return "".join(out)


class FakeEngine:
    """Emits prompt[-1]+1, +2, ... (mod 12) in chunks of 3, `delay` seconds per chunk; records what it ran."""

    def __init__(
        self, delay: float = 0.0, fail_on: int | None = None, gate: threading.Event | None = None
    ) -> None:
        """gate: every generation waits for it before its first chunk (a queue that fills whatever the clock)."""
        self.delay, self.fail_on, self.gate = delay, fail_on, gate
        self.last_stats = None
        self.started: list[list[int]] = []
        self.closed_after: list[int] = []

    def stream(self, prompt_ids, params):
        self.started.append(list(prompt_ids))

        def gen():
            n = 0
            try:
                if self.gate is not None:
                    assert self.gate.wait(60), "the test never opened the gate"
                while n < params.max_new_tokens:
                    if self.fail_on is not None and prompt_ids[-1] == self.fail_on:
                        raise RuntimeError("engine exploded")
                    time.sleep(self.delay)
                    k = min(3, params.max_new_tokens - n)
                    chunk = [(prompt_ids[-1] + n + j + 1) % 12 for j in range(k)]
                    n += k
                    yield chunk
            finally:
                self.closed_after.append(n)

        return gen()


def _expected(prompt_last: int, n: int) -> str:
    return "".join(ALPHABET[(prompt_last + j + 1) % 12] for j in range(n))


@pytest.fixture()
def serve_fake():
    """Factory: (engine, patch=None, ServerConfig kwargs) -> base URL of a uvicorn server in a thread; `patch(app)`
    may alter the app first. All stopped at the end."""
    servers = []

    def start(engine, patch=None, **cfg) -> str:
        app = create_app(engine, CharTokenizer(), ServerConfig(model_name="m", **cfg), max_model_len=40)
        if patch is not None:
            patch(app)
        url, server, thread = serve_in_thread(app, log_level="error", timeout=10)
        servers.append((server, thread))
        return url

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(10)


# ---------------------------------------------------------------- text


@pytest.mark.parametrize("seed", range(5))
def test_assembler_deltas_reassemble_and_cut_at_stop(seed):
    rng = random.Random(seed)
    tok = CharTokenizer()
    ids = [rng.randrange(12) for _ in range(60)]
    full = tok.decode(ids)
    stop = full[20:23]
    want = full[: full.index(stop)]
    a = TextAssembler(tok, [stop, "zz-never"])
    out, i = "", 0
    while i < len(ids) and not a.stopped:
        k = rng.randint(1, 4)
        delta = a.add(ids[i : i + k])
        out += delta
        # nothing sent may be the start of a stop string that could still complete
        assert not a.stopped or stop not in out
        i += k
    out += a.finish()
    assert a.stopped and out == want == a.text


def test_assembler_holds_back_partial_stop_and_incomplete_char():
    a = TextAssembler(CharTokenizer(), ["cd"])
    assert a.add([0, 1, 2]) == "ab"  # "c" may begin "cd": held back
    assert a.add([0]) == "ca"  # it did not
    assert a.add([13]) == ""  # an incomplete character is never sent
    assert a.add([1]) == "éb"
    assert a.add([2, 3, 4]) == "" and a.stopped and a.text == "abcaéb"
    assert a.finish() == ""


def test_fallback_chat_prompt():
    assert fallback_chat_prompt([("system", "S"), ("user", "U")]) == "system: S\nuser: U\nassistant:"


# ---------------------------------------------------------------- HTTP over a fake engine


def test_completion_chat_stream_and_usage(serve_fake):
    url = serve_fake(FakeEngine())
    r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "abc", "max_tokens": 7})
    assert r.status_code == 200, r.text
    res = r.json()
    assert res["choices"][0]["text"] == _expected(2, 7) and res["choices"][0]["finish_reason"] == "length"
    assert res["usage"] == {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}
    with httpx.stream(
        "POST",
        url + "/v1/chat/completions",
        json={
            "model": "m",
            "messages": [{"role": "user", "content": "a"}],
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    prompt = CharTokenizer()(fallback_chat_prompt([("user", "a")]))["input_ids"]
    assert text == _expected(prompt[-1], 5)
    assert events[-1]["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 5,
        "total_tokens": len(prompt) + 5,
    }
    assert all(e["usage"] is None for e in events[:-1])


def test_eos_and_default_max_tokens(serve_fake):
    url = serve_fake(FakeEngine(), max_tokens_default=100)
    # prompt ends with id 10 -> emits 11 then 0 ...; EOS id 12 is never produced here, so the context caps it
    r = httpx.post(
        url + "/v1/completions", json={"model": "m", "prompt": list(range(11)), "max_tokens": None}
    )
    assert r.json()["usage"]["completion_tokens"] == 40 - 11  # max_model_len - prompt


def test_errors_are_openai_shaped_and_server_keeps_serving(serve_fake):
    url = serve_fake(FakeEngine(fail_on=9), api_key="k")
    h = {"Authorization": "Bearer k"}
    cases = [
        ({}, {"model": "m", "prompt": "a"}, 401),
        (h, {"model": "x", "prompt": "a"}, 404),
        (h, {"model": "m", "prompt": "a", "max_tokens": 0}, 400),
        (h, {"model": "m", "prompt": "a", "n": 2}, 400),
        (h, {"model": "m", "prompt": ["a", "b"]}, 400),
        (h, {"model": "m", "prompt": [99]}, 400),
        (h, {"model": "m", "prompt": ""}, 400),
        (h, {"model": "m", "prompt": "a" * 41}, 400),
        (h, {"model": "m", "prompt": "a", "max_tokens": 40}, 400),
        (h, {"model": "m", "prompt": "a", "stop": 5}, 400),
        (h, {"model": "m", "prompt": "a", "best_of": 2}, 400),
        (h, {"model": "m", "prompt": "a", "presence_penalty": 0.5}, 400),
        (h, {"model": "m", "prompt": "a", "logit_bias": {"3": 5}}, 400),
    ]
    for headers, body, status in cases:
        r = httpx.post(url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == status, (body, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(url + "/v1/nothing-here", headers=h)
    assert r.status_code == 404 and "error" in r.json()
    # an engine failure is a 500 with an error body (non-streamed), in-band when streaming; then still serving
    r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "j"}, headers=h)
    assert r.status_code == 500 and "engine exploded" in r.json()["error"]["message"]
    with httpx.stream(
        "POST", url + "/v1/completions", json={"model": "m", "prompt": "j", "stream": True}, headers=h
    ) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert "engine exploded" in lines[-2] and lines[-1] == "data: [DONE]"
    ok = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "a", "max_tokens": 2}, headers=h)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == _expected(0, 2)


def test_requests_queue_to_one_worker_and_full_queue_is_503(serve_fake):
    gate = threading.Event()
    engine = FakeEngine(gate=gate)
    url = serve_fake(engine, max_queue=3)

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            body = {"model": "m", "prompt": "a", "max_tokens": 6}

            def post(i: int):
                return asyncio.create_task(
                    c.post("/v1/completions", json={**body, "prompt": ALPHABET[i % 10]})
                )

            # the first request running (the worker took it off the queue) before the other 7 arrive: on a loaded
            # machine the worker can be slower to take it than they are to come, and it would hold a queue slot
            tasks = [post(0)]
            for _ in range(600):
                if engine.started:
                    break
                await asyncio.sleep(0.05)
            tasks += [post(i) for i in range(1, 8)]
            # nothing finishes before the gate opens, however slow the machine: the 4 requests beyond 1 running +
            # 3 queued come back 503 while it is shut (waited for by count, not by the clock); then the rest run
            for _ in range(600):
                if sum(t.done() for t in tasks) >= 4:
                    break
                await asyncio.sleep(0.1)
            gate.set()
            return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    codes = sorted(r.status_code for r in results)
    # 8 held requests: 1 running + 3 queued are accepted, the other 4 are turned away
    assert codes.count(200) == 4 and codes.count(503) == 4, codes
    for r in results:
        if r.status_code == 200:
            p = r.json()
            assert len(p["choices"][0]["text"]) == 6
        else:
            assert r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"] == "1"


def test_client_disconnect_cancels_generation(serve_fake):
    engine = FakeEngine(delay=0.02)
    url = serve_fake(engine)
    body = {"model": "m", "prompt": "a", "max_tokens": 30, "stream": True}
    with httpx.Client(base_url=url, timeout=10) as c, c.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                break
    deadline = time.time() + 5
    while not engine.closed_after and time.time() < deadline:
        time.sleep(0.01)
    assert engine.closed_after and engine.closed_after[0] < 30
    metrics = httpx.get(url + "/metrics").text
    assert 'resispec:request_success_total{finished_reason="abort",model_name="m"} 1.0' in metrics
    # a non-streamed request whose client times out is cancelled too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=0.1)
    deadline = time.time() + 5
    while len(engine.closed_after) < 2 and time.time() < deadline:
        time.sleep(0.01)
    assert len(engine.closed_after) == 2 and engine.closed_after[1] < 30


def test_non_ascii_key_and_token(serve_fake):
    url = serve_fake(FakeEngine(), api_key="kéy")
    body = {"model": "m", "prompt": "a", "max_tokens": 2}
    with httpx.Client(base_url=url, timeout=10) as c:
        assert (
            c.post("/v1/completions", json=body, headers={"Authorization": "Bearer kéy".encode()}).status_code
            == 200
        )
        for auth in ("Bearer kéy".encode("latin-1"), "Bearer ключ".encode(), b"Bearer \xff", b"Bearer k"):
            r = c.post("/v1/completions", json=body, headers={"Authorization": auth})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_server_errors_never_take_the_next_request(serve_fake):
    """A 500 from the engine keeps the connection; an unexpected exception in the app is a 500 with an error body
    and `Connection: close`; either way the next request on the same client succeeds."""
    url = serve_fake(FakeEngine(fail_on=9))
    ok = {"model": "m", "prompt": "a", "max_tokens": 2}
    with httpx.Client(base_url=url, timeout=10) as c:
        for _ in range(3):
            r = c.post("/v1/completions", json={"model": "m", "prompt": "j"})
            assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
            assert c.post("/v1/completions", json=ok).status_code == 200
        metrics = c.get("/metrics").text
    assert 'resispec:request_errors_total{model_name="m"} 3.0' in metrics
    assert 'finished_reason="abort"' not in metrics  # a failed request is not an abort

    # an exception outside the request handlers' own error handling
    async def boom(req):
        raise RuntimeError("tokenizer on fire")

    def patch(app):
        app.state.server.completion_prompt = boom

    url = serve_fake(FakeEngine(), patch=patch)
    with httpx.Client(base_url=url, timeout=10) as c:
        for _ in range(3):
            r = c.post("/v1/completions", json=ok)
            assert r.status_code == 500 and r.headers["connection"] == "close"
            assert "tokenizer on fire" in r.json()["error"]["message"]
            chat = {"model": "m", "messages": [{"role": "user", "content": "a"}], "max_tokens": 2}
            assert c.post("/v1/chat/completions", json=chat).status_code == 200


def test_logprobs_need_a_scoring_engine_and_echo_works_without(serve_fake):
    url = serve_fake(FakeEngine())
    r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "ab", "logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    r = httpx.post(
        url + "/v1/completions", json={"model": "m", "prompt": "ab", "echo": True, "max_tokens": 3}
    )
    assert r.json()["choices"][0]["text"] == "ab" + _expected(1, 3)
    r = httpx.post(
        url + "/v1/completions", json={"model": "m", "prompt": "ab", "echo": True, "max_tokens": 0}
    )
    assert r.json()["choices"][0]["text"] == "ab" and r.json()["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize("temperature", [0.0, 5e-324, 1e-300, 1e-38, 1e-6, 1e-5, 0.3, 2.0])
@pytest.mark.parametrize("top_p", [5e-324, 1e-45, 1e-6, 0.5, 1.0])
@pytest.mark.parametrize("top_k", [0, 1, 7, 2**31 - 1])
def test_sampling_transform_is_finite_for_any_finite_settings(temperature, top_p, top_k):
    """The guard where probabilities are built: no NaN, so no sampled id outside the vocabulary."""

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen) * 30
    logits[0] = 0.0  # all ties
    logits[1, 3] = 1e4  # one dominant logit
    probs = process_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(6))
    ids = sample_tokens(probs, gen)
    assert ((ids >= 0) & (ids < 50)).all()
    if temperature < 1e-5 or top_p <= 1e-6 or top_k == 1:  # only a most likely token can come out
        assert torch.equal(logits.gather(-1, ids[:, None])[:, 0], logits.max(-1).values)


# ---------------------------------------------------------------- bench helpers


def test_write_report_writes_three_files(tmp_path: Path):
    rows = [
        BenchRow("ar", 0.0, num_tokens=10, seconds=1.0, tokens_per_second=10.0, tau=1.0, speedup=1.0),
        BenchRow(
            "spec",
            0.0,
            draft="d",
            rule="rrs",
            tree="[2,1]",
            tokens_per_second=15.0,
            tau=2.0,
            tau_stderr=0.125,
            per_depth_acceptance=[0.8, 0.5],
            c=0.1,
            speedup=1.5,
        ),
        BenchRow(
            "hf_assisted", 0.0, draft="d", rule="hf", tree="chain 2", tokens_per_second=12.0, speedup=1.2
        ),
    ]
    paths = write_report(rows, tmp_path, {"target": "t"})
    assert {p.name for p in tmp_path.iterdir()} >= {"report.md", "report.json", "speedup.png"}
    md = paths["md"].read_text()
    assert "| 0 | spec | d | rrs | [2,1] | 15.0 | 2.00 | 0.12 | 0.80 0.50 | 0.100 | 1.50 |" in md
    assert "| 0 | ar | - | - | - | 10.0 | 1.00 | - |" in md  # no steps, no standard error
    data = json.loads(paths["json"].read_text())
    assert [r["label"] for r in data["rows"]] == ["AR", "rrs [2,1] (d)", "HF assisted chain 2 (d)"]
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"


class Bar:
    """A progress bar that shows nothing (the bench's timing loops take one)."""

    total = 0

    def set_postfix_str(self, _):
        pass

    def update(self):
        pass


def test_speed_bench_rounds_reverse_the_order_with_fresh_seeds_and_show_their_spread(monkeypatch, tmp_path):
    """bench.rounds: each round its own prompts (consecutive blocks), each through every method in turn, the order
    reversed every other round (ABBA), the same seed for every method (bench.seed + the prompt's index); the
    speedup is over all rounds, each row keeps its per-round speedups and the report states their spread."""
    import resispec.benchmark.speed as speed
    from resispec.benchmark.results import Method

    clock = [0.0]
    monkeypatch.setattr(speed.time, "perf_counter", lambda: clock[0])
    calls = []

    def method(row: BenchRow, seconds_by_round: list[float]) -> Method:
        def run(prompt, seed, max_new_tokens):
            if max_new_tokens == 8:  # the untimed warm-up
                return 8, None
            rnd = len([c for c in calls if c[0] == row.label]) // 2  # 2 prompts a round
            calls.append((row.label, prompt[0], seed))
            clock[0] += seconds_by_round[rnd]
            return 10, None

        return Method(row, run)

    # round 1 is a slow phase of the machine (every method twice as slow); the spec row is 2x AR in both rounds,
    # the other spec row 2x in round 0 and 2.5x in round 1
    methods = [
        method(BenchRow("ar", 1.0), [1.0, 2.0]),
        method(BenchRow("spec", 1.0, "d", "chain", "[1]"), [0.5, 1.0]),
        method(BenchRow("spec", 1.0, "d", "rrs", "[1]"), [0.5, 0.8]),
    ]

    bench = BenchConfig(rounds=2, seed=5, warmup=1, max_new_tokens=16)
    speed.time_methods(methods, [[100], [200], [300], [400]], bench, 1.0, torch.device("cpu"), Bar())
    labels = [m.row.label for m in methods]
    assert [c[0] for c in calls] == labels + labels + labels[::-1] + labels[::-1]  # ABBA
    assert [c[1] for c in calls] == [100] * 3 + [200] * 3 + [300] * 3 + [400] * 3  # round 1: its own prompts
    assert [c[2] for c in calls] == [5] * 3 + [6] * 3 + [7] * 3 + [8] * 3  # seed + the prompt's index
    assert speed.round_prompts([[1], [2], [3]], 5) == [
        [(0, [1])],
        [(1, [2])],
        [(2, [3])],
    ]  # a round a prompt at most
    assert speed.round_prompts([[1], [2], [3]], 2) == [[(0, [1]), (1, [2])], [(2, [3])]]
    rows = speed.fill_rows(methods, 4, {}, None)
    assert [r.num_tokens for r in rows] == [40, 40, 40]
    assert rows[1].speedup == pytest.approx(2.0) and rows[1].stats["round_speedups"] == pytest.approx(
        [2.0, 2.0]
    )
    assert rows[2].stats["round_speedups"] == pytest.approx([2.0, 2.5])
    assert rows[2].speedup == pytest.approx(6.0 / 2.6)  # over all rounds: 40 tokens in 2.6 s against 6 s
    md = write_report(rows, tmp_path, {"rounds": 2})["md"].read_text()
    assert "Rounds: 2 interleaved rounds, each on its own prompts" in md
    assert "moved by a median 12.5% and at most 25.0%" in md  # the spec rows' spreads: 0% and 25% (AR: none)
    assert "Rounds:" not in write_report(rows[:1], tmp_path, {})["md"].read_text()  # one round: no line


def test_plan_head_to_head_re_times_the_sweeps_pick_beside_the_plan_and_keeps_each_calls_fastest(
    monkeypatch, tmp_path
):
    """bench.plan_confirm_repeats: after the sweep, AR, every planned row and the best fixed row of its rule (by the
    sweep's speedup) are timed again on the first round's prompts, the order reversed every other prompt and
    repeat, each (method, prompt) at its fastest; a plan of the best fixed tree itself re-times no second row, a
    rule without fixed rows gets no comparison; the report shows the sweep's and the head-to-head's ratios."""
    import resispec.benchmark.speed as speed
    from resispec.benchmark.results import Method

    clock = [0.0]
    monkeypatch.setattr(speed.time, "perf_counter", lambda: clock[0])
    calls: list[tuple[str, int, int]] = []

    def method(
        row: BenchRow, seconds: float, sweep_speedup: float, burst: int | None = None, steps: int = 0
    ) -> Method:
        row.speedup = sweep_speedup

        def run(prompt, seed, max_new_tokens):
            calls.append((row.label, prompt[0], seed))
            n = len([c for c in calls if c[0] == row.label])
            clock[0] += seconds * (10 if n == burst else 1)  # a burst of the machine in one call
            # a decode of `steps` steps emitting 10 tokens (tau 10 / steps), or one without stats (AR, steps 0);
            # in the burst call one step more: the head-to-head keeps its fastest call's
            stats = (
                DecodeStats(num_drafts=steps + (n == burst), num_accepted_tokens=10 - steps)
                if steps
                else None
            )
            return 10, stats

        return Method(row, run)

    def planned(rule: str, tree: str, speedup: float) -> BenchRow:
        return BenchRow("spec", 1.0, "d", rule, tree, stats={"plan": {"tau": 2.0, "speedup": speedup}})

    methods = [
        method(BenchRow("ar", 1.0), 1.0, 1.0, burst=1),
        # the sweep's pick (lucky)
        method(BenchRow("spec", 1.0, "d", "resispec", "[1,1]"), 0.5, 2.1, steps=4),
        method(BenchRow("spec", 1.0, "d", "resispec", "[4,2]"), 0.6, 1.5),
        method(BenchRow("spec", 1.0, "d", "chain", "[1,1]"), 0.5, 1.9),
        method(planned("resispec", "auto[2,1]", 2.2), 0.45, 1.8, burst=2, steps=5),  # truly faster than [1,1]
        method(planned("chain", "auto[1,1]", 2.0), 0.5, 1.8),  # the best fixed tree itself
        method(planned("hub", "auto[3]", 1.2), 0.8, 1.2),  # no fixed rows of its rule
    ]

    bench = BenchConfig(rounds=2, seed=5, max_new_tokens=16, plan_confirm_repeats=2)
    speed.confirm_plans(methods, [[100], [200], [300], [400]], bench, 1.0, torch.device("cpu"), Bar())
    group = ["AR", "resispec auto[2,1] (d)", "resispec [1,1] (d)", "chain auto[1,1] (d)", "hub auto[3] (d)"]
    assert [c[0] for c in calls] == group + group[::-1] + group[::-1] + group  # prompt x repeat, alternating
    # round 1's prompts, with their seeds
    assert [c[1:] for c in calls[:: len(group)]] == [(100, 5), (200, 6), (100, 5), (200, 6)]
    h = {m.row.tree: m.row.stats.get("head_to_head") for m in methods}
    assert h["[1,1]"] is None and h["[4,2]"] is None  # fixed rows carry no head-to-head of their own
    assert h["auto[2,1]"]["speedup"] == pytest.approx(1 / 0.45)  # AR's burst dropped: its fastest is 1.0 s
    assert h["auto[2,1]"]["best_fixed"] == "[1,1]" and h["auto[2,1]"]["best_speedup"] == pytest.approx(2.0)
    assert h["auto[2,1]"]["ratio"] == pytest.approx(0.5 / 0.45) and not h["auto[2,1]"]["same_tree"]
    # the tau its fastest calls decoded (10 tokens in 5 steps each: its burst call's 6 steps not among them)
    assert h["auto[2,1]"]["tau"] == pytest.approx(2.0) and h["auto[2,1]"]["best_tau"] == pytest.approx(2.5)
    assert h["auto[3]"]["tau"] is None  # a method without DecodeStats
    assert h["auto[1,1]"]["same_tree"] and h["auto[1,1]"]["ratio"] == 1.0
    assert "best_fixed" not in h["auto[3]"] and h["auto[3]"]["speedup"] == pytest.approx(1.25)
    assert (h["auto[2,1]"]["prompts"], h["auto[2,1]"]["repeats"]) == (2, 2)
    md = write_report([m.row for m in methods], tmp_path, {})["md"].read_text()
    assert "tree=auto head-to-head, after the sweep" in md
    # sweep: 1.8 / 2.1 = 0.86 behind the lucky pick; head-to-head: 2.22 / 2.00 = 1.11 ahead; predicted 2.2: -1.0%
    assert "| 1 | resispec auto[2,1] (d) | 2.20 | 1.80 | 2.22 | -1.0% | [1,1] 2.00 | 0.86 | 1.11 |" in md
    assert "| 1 | chain auto[1,1] (d) | 2.00 | 1.80 | 2.00 | +0.0% | [1,1] 2.00 | 0.95 | 1.00 (=) |" in md
    assert "| 1 | hub auto[3] (d) | 1.20 | 1.20 | 1.25 | -4.0% | - | - | - |" in md
    confirmed = len(calls)
    off = BenchConfig(plan_confirm_repeats=0)
    speed.confirm_plans(methods, [[100]], off, 1.0, torch.device("cpu"), Bar())
    assert len(calls) == confirmed  # 0: off
    bench = BenchConfig(rounds=2, seed=5, max_new_tokens=16, plan_confirm_repeats=1, plan_confirm_prompts=3)
    speed.confirm_plans(methods, [[100], [200], [300], [400]], bench, 1.0, torch.device("cpu"), Bar())
    assert [c[1:] for c in calls[confirmed :: len(group)]] == [(100, 5), (200, 6), (300, 7)]  # the first 3
    assert methods[4].row.stats["head_to_head"]["prompts"] == 3


def test_plan_pool_check_counts_the_plans_tau_on_more_prompts_and_carries_the_timed_speedups(
    micro_world, tmp_path
):
    """bench.plan_check_prompts: each planned tree and the best fixed tree of its rule are counted on a pool of
    prompts (the bench's first), and the timed speedup (the head-to-head's, else the sweep's) is carried to the
    pool's tau over the tau of the prompts it was timed on. T = 0: every tree, each tau equal to the decoder's own
    over the same prompts (EOS ignored). T = 1: chains only, the product model with alpha(1) = sum min(p, q) (one
    draw of an exact rule) averaged over each prompt's sampled continuation. The report shows them."""
    import resispec.benchmark.speed as speed
    from resispec.analysis.headroom import token_windows
    from resispec.benchmark.results import Method
    from resispec.decoding import SpeculativeDecoder
    from resispec.decoding.planner import expected_tau
    from resispec.models import stdlib_splits
    from tests.fixtures_world import micro_models
    from tests.unit.test_decoding_helpers import single_thread

    world, paths = micro_world
    tok, target, draft = micro_models(paths)
    pool = [
        w[: 10 + 3 * i] for i, w in enumerate(token_windows(tok, stdlib_splits(world)["test"], 6, 64, 16))
    ]
    tokens = 12

    def decoded_tau(tree: list[int], prompts: list[list[int]]) -> float:
        dec = SpeculativeDecoder(target, draft, rule="resispec", tree=tree)
        steps = accepted = 0
        for p in prompts:
            out = dec.generate(torch.tensor([p]), max_new_tokens=tokens, temperature=0.0, eos_token_id=[])
            steps, accepted = steps + out.stats.num_drafts, accepted + out.stats.num_accepted_tokens
        return (steps + accepted) / steps

    def row(t: float, tree: str, speedup: float, **stats) -> BenchRow:
        return BenchRow("spec", t, "d", "resispec", tree, speedup=speedup, stats=stats)

    h2h = {"speedup": 1.5, "prompts": 2, "repeats": 2, "best_fixed": "[1,1,1]", "best_speedup": 1.6}
    h2h.update(ratio=1.5 / 1.6, same_tree=False)
    methods = [
        Method(row(0.0, "[1,1,1]", 1.7), None),  # the sweep's best fixed row of the rule
        Method(row(0.0, "[4,2]", 1.2), None),
        Method(row(0.0, "auto[2,1]", 1.4, plan={"tau": 2.0, "speedup": 1.45}, head_to_head=h2h), None),
        Method(
            row(0.0, "auto[3]", 1.1, plan={"tau": 1.5, "speedup": 1.0}), None
        ),  # no head-to-head: the sweep's
    ]
    greedy = dict(temperature=0.0, top_k=0, top_p=1.0, max_new_tokens=tokens)
    with single_thread():
        speed.check_plans_on_pool(methods, pool[:3], pool[:3], target, {"d": draft}, greedy)
        assert not any("pool" in m.row.stats for m in methods)  # no prompt beyond the bench's: no check
        speed.check_plans_on_pool(methods, pool[:3], pool, target, {"d": draft}, greedy)
        g, g3 = methods[2].row.stats["pool"], methods[3].row.stats["pool"]
        assert (g["prompts"], g["timed_prompts"], g["timed_by"]) == (6, 2, "head-to-head")
        assert (g3["timed_prompts"], g3["timed_by"]) == (3, "sweep")
        assert g["tau"] == pytest.approx(decoded_tau([2, 1], pool))
        assert g["tau_timed"] == pytest.approx(decoded_tau([2, 1], pool[:2]))
        assert g["best_tau"] == pytest.approx(decoded_tau([1, 1, 1], pool))
        assert g["best_tau_timed"] == pytest.approx(decoded_tau([1, 1, 1], pool[:2]))
        assert g3["tau_timed"] == pytest.approx(decoded_tau([3], pool[:3]))
    # no decoded tau recorded (the test's rows): the count
    assert g["speedup"] == pytest.approx(1.5 * g["tau"] / g["tau_timed"])
    assert g["tau_decoded"] == g["tau_timed"]
    assert g["best_fixed"] == "[1,1,1]"
    assert g["best_speedup"] == pytest.approx(1.6 * g["best_tau"] / g["best_tau_timed"])
    assert g["ratio"] == pytest.approx(g["speedup"] / g["best_speedup"])
    assert g3["speedup"] == pytest.approx(1.1 * g3["tau"] / g3["tau_timed"])
    assert g3["best_speedup"] == pytest.approx(1.7 * g3["best_tau"] / decoded_tau([1, 1, 1], pool[:3]))
    assert "pool" not in methods[0].row.stats  # fixed rows carry none of their own

    # T = 1: a planned chain against a fixed chain, a planned tree whose own tau the model does not carry; the
    # head-to-head's calls decoded tau 1.7 and 2.1 (their draws' luck): the carried speedups divide by those
    decoded = dict(h2h, tau=1.7, best_tau=2.1)
    sampled = [
        Method(row(1.0, "[1,1,1]", 1.6), None),
        Method(row(1.0, "auto[1,1]", 1.3, plan={"tau": 1.8, "speedup": 1.35}, head_to_head=decoded), None),
        Method(row(1.0, "auto[2,1]", 1.2, plan={"tau": 1.9, "speedup": 1.25}), None),
    ]
    settings = dict(temperature=1.0, top_k=0, top_p=1.0)
    with single_thread(), torch.inference_mode():
        speed.check_plans_on_pool(
            sampled, pool[:3], pool, target, {"d": draft}, dict(settings, max_new_tokens=8)
        )
        seqs = speed.sampled_continuations(target, pool, speed.POOL_SAMPLED_TOKENS, settings, speed.POOL_SEED)
        alphas = []
        for p, seq in zip(pool, seqs, strict=True):
            assert seq[: len(p)] == p and len(seq) == len(p) + speed.POOL_SAMPLED_TOKENS
            ids = torch.tensor([seq])
            pt, qt = (
                torch.softmax(m(input_ids=ids).logits[0, len(p) - 1 : -1].double(), -1)
                for m in (target, draft)
            )
            alphas.append(float(torch.minimum(pt, qt).sum(-1).mean()))

    def model_tau(tree: list[int], k: int) -> float:
        return expected_tau(tree, {1: sum(alphas[:k]) / k})

    s1, s2 = sampled[1].row.stats["pool"], sampled[2].row.stats["pool"]
    assert s1["tau"] == pytest.approx(model_tau([1, 1], 6)) and s1["tau_timed"] == pytest.approx(
        model_tau([1, 1], 2)
    )
    assert s1["best_tau"] == pytest.approx(model_tau([1, 1, 1], 6))
    assert s1["speedup"] == pytest.approx(1.5 * s1["tau"] / 1.7) and s1["tau_decoded"] == 1.7
    assert s1["best_speedup"] == pytest.approx(1.6 * s1["best_tau"] / 2.1)
    assert s1["ratio"] == pytest.approx(s1["speedup"] / s1["best_speedup"])
    assert 0.05 < min(alphas) and max(alphas) < 0.95 and s1["tau"] != s1["tau_timed"]  # prompts that differ
    assert "speedup" not in s2 and "ratio" not in s2  # [2,1]: not carried at T > 0
    assert s2["best_tau_timed"] == pytest.approx(model_tau([1, 1, 1], 3))  # the sweep's 3 prompts
    md = write_report([m.row for m in methods + sampled], tmp_path, {})["md"].read_text()
    assert "tree=auto on 6 test prompts" in md
    line = next(
        x for x in md.splitlines() if x.startswith("| 0 | resispec auto[2,1] (d) | 2 (head-to-head) |")
    )
    assert f"| {1.45 / g['speedup'] - 1:+.1%} |" in line and line.endswith(f"| {g['ratio']:.3f} |")
    line = next(x for x in md.splitlines() if x.startswith("| 1 | resispec auto[2,1] (d) | 3 (sweep) |"))
    assert "| 3 (sweep) | - | - | - | - | [1,1,1] " in line and line.endswith("| - |")


def test_sum_stats_adds_counters():
    a = DecodeStats(
        num_drafts=2, num_accepted_tokens=3, accepted_per_position=[2, 1], reached_per_position=[2, 1]
    )
    b = DecodeStats(
        num_drafts=1, num_accepted_tokens=0, accepted_per_position=[0, 0], reached_per_position=[1, 0]
    )
    s = sum_stats([a, b])
    assert s.num_drafts == 3 and s.accepted_per_position == [2, 1] and s.reached_per_position == [3, 1]
    assert s.tau == pytest.approx((3 + 3) / 3)
    assert s.tau_stderr is None  # counters without the per-step squares (vLLM's)


def test_tau_standard_error_over_steps_and_prompts():
    """tau's standard error: the sample standard deviation of the accepted tokens per step over sqrt(steps),
    summed over prompts like every counter (the bench prints it beside tau)."""

    a, b = DecodeStats(), DecodeStats()
    for acc in (0, 2):
        a.record_step(5, acc, 4)
    b.record_step(5, 4, 4)
    s = sum_stats([a, b])
    assert s.accepted_sq == 0 + 4 + 16 and s.tau == pytest.approx(3.0)
    assert s.tau_stderr == pytest.approx((4.0 / 3) ** 0.5)  # accepted 0, 2, 4: sample variance 4, 3 steps
    assert DecodeStats().tau_stderr is None and a.as_dict()["tau_stderr"] == pytest.approx(1.0)


def test_load_test_is_localhost_only_and_percentiles():
    for url in ("http://example.com:8000", "http://10.0.0.1:8000", "https://api.openai.com"):
        with pytest.raises(ValueError, match="this machine"):
            run_load_test(url, ["x"], BenchConfig())
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0 and percentile([3.0, 1.0, 2.0, 4.0], 95) == 4.0


def test_load_test_against_fake_server(serve_fake, tmp_path):
    url = serve_fake(FakeEngine(delay=0.01))
    bench = BenchConfig(concurrency=3, num_requests=7, max_new_tokens=5, temperatures=[0.0])
    res = run_load_test(url, ["abc", "de"], bench, output_dir=tmp_path, show=False)
    assert res.num_ok == 7 and res.num_failed == 0 and res.completion_tokens == 35
    assert 0 < res.latency_p50 <= res.latency_p95 and res.tokens_per_second > 0
    assert (tmp_path / "report.md").exists() and json.loads((tmp_path / "report.json").read_text())[
        "num_ok"
    ] == 7


def test_server_flag_becomes_override():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "load_script", Path(__file__).parents[2] / "bench" / "load.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.server_flag_to_override(["--server", "http://127.0.0.1:1", "a=b"]) == [
        "bench.server_url=http://127.0.0.1:1",
        "a=b",
    ]
    assert mod.server_flag_to_override(["--server=http://localhost:2"]) == [
        "bench.server_url=http://localhost:2"
    ]
    # several servers (or a labelled one): one quoted list, which Hydra reads back as written
    flags = ["--server", "batched AR=http://127.0.0.1:1", "a=b", "--server=it's=http://localhost:2"]
    overrides = mod.server_flag_to_override(flags)
    assert overrides[1:] == ["a=b"]
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).parents[2] / "conf"), version_base="1.3"):
        cfg = to_typed(compose(config_name="bench", overrides=overrides[:1]))
    assert cfg.bench.server_urls == ["batched AR=http://127.0.0.1:1", "it's=http://localhost:2"]


def test_servers_are_parsed_with_labels_and_bad_lists_are_refused():
    assert parse_servers(None, []) == {}
    assert parse_servers("http://127.0.0.1:5", []) == {"server": "http://127.0.0.1:5"}
    assert parse_servers(None, ["ar=http://127.0.0.1:5", "http://localhost:6/", "x?=http://[::1]:7"]) == {
        "ar": "http://127.0.0.1:5",
        "localhost:6": "http://localhost:6/",
        "x?": "http://[::1]:7",
    }
    for bad, match in (
        (["ar"], "not LABEL=URL"),
        (["a=ftp://x"], "not LABEL=URL"),
        (["a=http://127.0.0.1:1", "a=http://127.0.0.1:2"], "given twice"),
        (["http://127.0.0.1:1", "http://127.0.0.1:1"], "given twice"),
    ):
        with pytest.raises(LoadTestError, match=match):
            parse_servers(None, bad)


def test_interleaved_sweep_alternates_the_servers_and_reports_their_ratios(serve_fake, tmp_path):
    log = []

    class Logged(FakeEngine):
        def __init__(self, name: str, delay: float) -> None:
            super().__init__(delay)
            self.name = name

        def stream(self, prompt_ids, params):
            log.append(self.name)
            return super().stream(prompt_ids, params)

    urls = {"slow": serve_fake(Logged("slow", 0.03)), "fast": serve_fake(Logged("fast", 0.003))}
    bench = BenchConfig(concurrencies=[1, 2], num_requests=2, max_new_tokens=6, temperatures=[0.0], rounds=2)
    results = run_interleaved(urls, ["abc"], bench, output_dir=tmp_path, show=False)
    # every level on each server in turn, the order reversed in the second round (ABBA); 2 requests per test
    assert (
        log[::2] == ["slow", "fast", "slow", "fast", "fast", "slow", "fast", "slow"] and log[::2] == log[1::2]
    )
    assert [(r.label, r.concurrency, r.num_ok, r.num_requests) for r in results] == [
        ("slow", 1, 4, 4),
        ("slow", 2, 4, 4),
        ("fast", 1, 4, 4),
        ("fast", 2, 4, 4),
    ]
    by = {(r.label, r.concurrency): r for r in results}
    md = (tmp_path / "sweep.md").read_text()
    assert "| clients | fast / slow tok/s | slow: p95 / lone | fast: p95 / lone |" in md
    for level in (1, 2):
        row = next(line for line in md.splitlines() if line.startswith(f"| {level} |")).split("|")
        speedup = by[("fast", level)].tokens_per_second / by[("slow", level)].tokens_per_second
        assert row[2].strip() == f"{speedup:.2f}x" and speedup > 1.5
        assert row[3].strip() == f"{by[('slow', level)].latency_p95 / by[('slow', 1)].latency_p50:.2f}x"
    assert json.loads((tmp_path / "sweep.json").read_text())[0]["label"] == "slow"
    # a server that does not answer stops the sweep before it starts, in one line
    with pytest.raises(LoadTestError, match="'gone' at http://127.0.0.1:9/ does not answer"):
        run_interleaved({**urls, "gone": "http://127.0.0.1:9/"}, ["abc"], bench, show=False)
    assert len(log) == 16  # no request was sent
    # one server without a lone level: nothing to compare
    assert comparison_table([by[("slow", 2)]]) == ""
    assert comparison_table([by[("slow", 1)]]).startswith("e2e p95 latency over a lone request")


def test_encode_chat_uses_the_tokenizer_template_when_present():
    class Templated(CharTokenizer):
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            assert add_generation_prompt and not tokenize
            return "|".join(m["content"] for m in messages) + " "

    assert encode_chat(Templated(), [("user", "ab"), ("user", "c")]) == Templated()("abc ")["input_ids"]
    plain = CharTokenizer()
    assert encode_chat(plain, [("user", "ab")]) == plain(fallback_chat_prompt([("user", "ab")]))["input_ids"]


def test_serving_threads_take_every_core_or_leave_one():
    import os

    import torch

    before = torch.get_num_threads()
    try:
        assert serving_threads(ServerConfig(num_threads=3)) == 3 and torch.get_num_threads() == 3
        cores = len(os.sched_getaffinity(0))
        assert serving_threads(ServerConfig()) == cores == torch.get_num_threads()
        assert (
            serving_threads(ServerConfig(), spare_core=True) == max(1, cores - 1) == torch.get_num_threads()
        )
    finally:
        torch.set_num_threads(before)


def test_small_batches_leave_a_core_to_the_frontend():
    """server.spare_core_below: below that many running requests decoding takes one thread fewer (never fewer than
    one); the scheduler sets it at each cycle from the running and waiting requests (at most max_batch_size)."""
    from types import SimpleNamespace

    import torch

    at = threads_by_rows(ServerConfig(spare_core_below=5), 4)
    assert [at(r) for r in (1, 4, 5, 16)] == [3, 3, 4, 4]
    assert threads_by_rows(ServerConfig(spare_core_below=5), 1)(1) == 1
    assert threads_by_rows(ServerConfig(spare_core_below=0), 2)(1) == 2
    assert ServerConfig().spare_core_below == 5

    asked = []
    engine = SimpleNamespace(batched=SimpleNamespace(draft=None, rows=[]), generator=None, eos=None)
    sched = Scheduler(engine, max_batch_size=4, threads_at=lambda rows: asked.append(rows) or 1 + (rows >= 3))
    sched.close()  # no decode thread: cycles are driven by hand
    sched._admit = lambda: 0
    sched._step = lambda: None
    before = torch.get_num_threads()
    try:
        for running, waiting, rows, threads in ((1, 0, 1, 1), (1, 1, 2, 1), (2, 5, 4, 2), (0, 0, 1, 1)):
            sched.tasks[:] = [SimpleNamespace()] * running
            sched.waiting.clear()
            sched.waiting.extend([SimpleNamespace()] * waiting)
            sched._cycle()
            assert asked[-1] == rows and torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)


def test_off_main_thread_returns_and_raises_from_another_thread():
    main = threading.get_ident()
    assert off_main_thread(lambda a, b=0: (a + b, threading.get_ident()), 2, b=3)[0] == 5
    assert off_main_thread(threading.get_ident) != main
    with pytest.raises(KeyError, match="boom"):
        off_main_thread(lambda: {}["boom"])


def test_outbox_delivers_a_cycle_in_one_wakeup_per_loop_in_order():
    """The decode thread's hand-offs of one cycle reach each event loop in one call_soon_threadsafe, each job's
    items in the order they were put; a loop that is gone cancels its jobs instead of raising."""
    from types import SimpleNamespace

    class Loop:
        def __init__(self, closed=False):
            self.calls, self.closed = [], closed

        def call_soon_threadsafe(self, fn, *args):
            if self.closed:
                raise RuntimeError("Event loop is closed")
            self.calls.append((fn, args))

    def job(loop):
        return SimpleNamespace(loop=loop, events=asyncio.Queue(), cancel=lambda: cancelled.append(loop))

    cancelled = []
    one, two, gone = Loop(), Loop(), Loop(closed=True)
    a, b, c, d = job(one), job(one), job(two), job(gone)
    box = Outbox()
    for j, item in ((a, [1]), (b, [7]), (a, [2, 3]), (c, [9]), (d, [5]), (a, "end")):
        box.put(j, item)
    box.flush()
    assert len(one.calls) == len(two.calls) == 1 and cancelled == [gone]
    for loop in (one, two):
        fn, args = loop.calls[0]
        fn(*args)
    assert [a.events.get_nowait() for _ in range(3)] == [[1], [2, 3], "end"]
    assert b.events.get_nowait() == [7] and c.events.get_nowait() == [9] and d.events.empty()
    box.flush()  # nothing left: no call
    assert len(one.calls) == 1


def test_build_app_does_its_model_work_off_the_main_thread(monkeypatch):
    """Loading, the decoder's forward (its weights are concatenated and packed when it is built) and the engine run
    in a thread that exits: parallel torch work on the main thread leaves an OpenMP team behind that slowed the
    decode thread's steps 1.5x (off_main_thread)."""
    from types import SimpleNamespace

    on_main = {}

    def recorder(name, result):
        def record(*args, **kwargs):
            on_main[name] = threading.current_thread() is threading.main_thread()
            return result

        return record

    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64))
    monkeypatch.setattr(srv, "load_pair", recorder("load_pair", (model, model, "tokenizer")))
    monkeypatch.setattr(srv, "fast_forward", recorder("fast_forward", object()))
    engine = SimpleNamespace(decoder=SimpleNamespace(shape=[1]))
    monkeypatch.setattr(srv, "build_engine", recorder("build_engine", engine))
    monkeypatch.setattr(srv, "create_app", lambda engine, *args, **kwargs: ("app", engine))
    before = torch.get_num_threads()
    try:
        app = srv.build_app(
            ServerConfig(), DecodeConfig(rule="ar"), ModelConfig(path="t"), ModelConfig(path="d")
        )
    finally:
        torch.set_num_threads(before)
    assert app == ("app", engine)
    assert threading.current_thread() is threading.main_thread()  # else the test proves nothing
    assert on_main == {"load_pair": False, "fast_forward": False, "build_engine": False}


def test_load_requests_carry_a_seed_unless_told_not_to():
    import asyncio
    import json

    import httpx

    bodies = []
    stream = (
        'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [], "usage": {"completion_tokens": 1}}\n\n'
    )

    def handler(request):
        bodies.append(json.loads(request.content))
        return httpx.Response(200, text=stream + "data: [DONE]\n\n")

    async def run(bench):
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await one_request(client, "m", "hi", bench, 1.0, seed=7)

    assert asyncio.run(run(BenchConfig()))[2] == 1 and bodies[-1]["seed"] == 7
    asyncio.run(run(BenchConfig(seeded_requests=False)))
    assert "seed" not in bodies[-1] and bodies[-1]["temperature"] == 1.0


def test_load_requests_time_the_gaps_between_their_streamed_chunks():
    """ITL: the seconds between two chunks of text of one streamed request; events without text (the usage
    chunk, a role delta) are not chunks."""
    import asyncio

    import httpx

    events = ['{"choices": [{"text": "a"}]}'] * 3 + ['{"choices": [{"text": ""}]}']
    events.append('{"choices": [], "usage": {"completion_tokens": 3}}')
    body = "".join(f"data: {e}\n\n" for e in events) + "data: [DONE]\n\n"

    async def run():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body))
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await one_request(client, "m", "hi", BenchConfig(), 1.0, seed=7)

    latency, ttft, tokens, gaps = asyncio.run(run())
    assert tokens == 3 and len(gaps) == 2 and all(0 <= g <= latency for g in gaps) and ttft <= latency


def test_rounds_merge_over_the_summed_wall_clock():
    def run(wall, tokens, p50, tau):
        rates = dict(tokens_per_second=tokens / wall, requests_per_second=8 / wall)
        return LoadTestResult(
            url="u", model="m", concurrency=4, num_requests=8, num_ok=8, num_failed=0, temperature=1.0,
            max_tokens=48, wall_seconds=wall, completion_tokens=tokens, latency_p50=p50, latency_p95=2 * p50,
            ttft_p50=0.1, ttft_p95=0.2, server_tau=tau, label="x", **rates,
        )  # fmt: skip

    a, b = run(2.0, 384, 1.0, 1.5), run(4.0, 384, 2.0, None)
    a.steps = {"draft": [10, 0.5, 40], "ar": [30, 0.6, 120]}
    b.steps = {"ar": [20, 0.4, 80]}
    m = merge_rounds([a, b])
    # tokens/s over the summed wall-clock, not the mean of the rounds' rates
    assert m.tokens_per_second == 768 / 6.0 and m.num_ok == 16 and m.num_requests == 16
    assert m.latency_p50 == 1.5 and m.latency_p95 == 3.0 and m.server_tau == 1.5 and m.label == "x"
    # the batch steps are summed: shares and costs per token over both rounds
    assert m.steps == {"draft": [10, 0.5, 40], "ar": [50, 1.0, 200]}
    assert m.drafted_share == 10 / 60 and m.draft_ms_per_token == 12.5 and m.ar_ms_per_token == 5.0
    assert merge_rounds([a]) is a
    assert m.itl_p99 is None  # no round timed chunks
    a.itl_p99, a.itl_p50 = 0.04, 0.01
    assert merge_rounds([a, b]).itl_p99 == 0.04  # the rounds that did
    b.itl_p99 = 0.02
    assert merge_rounds([a, b]).itl_p99 == 0.03
    assert b.drafted_share == 0.0 and b.draft_ms_per_token is None
    assert run(1.0, 8, 1.0, None).drafted_share is None  # no batch steps counted (a peer, a stream server)


def test_metrics_scrape_counts_the_batch_steps_by_mode():
    m = ServerMetrics("m")
    before = scrape_metrics(m.render().decode())
    m.observe_step("draft", 0.03, 5, 2)
    m.observe_step("draft", 0.05, 7, 4)
    m.observe_step("ar", 0.01, 4, 4)
    text = m.render().decode()
    assert 'resispec:batch_steps_total{batch_size="4",mode="draft",model_name="m"} 1.0' in text
    after = scrape_metrics(text)  # summed over the batch sizes
    counts = step_counts(before, after)
    assert counts["draft"][0] == 2 and counts["draft"][2] == 12 and counts["ar"] == [1, 0.01, 4]
    assert abs(counts["draft"][1] - 0.08) < 1e-9
    assert step_counts(after, after) == {}


def test_request_lengths_vary_by_the_range_ratio_the_same_on_every_server():
    assert {request_max_tokens(BenchConfig(max_new_tokens=48), i) for i in range(50)} == {48}
    bench = BenchConfig(max_new_tokens=48, output_len_range_ratio=0.5)
    lengths = [request_max_tokens(bench, i) for i in range(400)]
    assert lengths == [request_max_tokens(bench, i) for i in range(400)]  # deterministic per request
    assert min(lengths) >= 24 and max(lengths) <= 72 and len(set(lengths)) > 30
    assert abs(sum(lengths) / len(lengths) - 48) < 2


def test_step_cost_model_fits_a_line_in_the_rows():
    """Seconds per step as a least-squares line in the rows (an occasional dear step counts: it is a real cost),
    weighted towards the rows asked about, over the tokens each row emits; a single row count gives a flat line,
    a falling one is clamped flat."""
    import pytest

    model = StepCostModel()
    for rows in range(1, 9):
        for extra in (0.0, 0.0, 0.003):  # every third step also prefills a newcomer's prompt on the draft
            model.add(rows, 0.010 + 0.002 * rows + extra, 2 * rows)
    intercept, slope, per_row = model.fit()
    assert intercept == pytest.approx(0.011) and slope == pytest.approx(0.002) and per_row == 2.0
    assert model.per_token(4) == pytest.approx(0.019 / 8)
    flat = StepCostModel()
    for seconds in (0.02, 0.03, 0.04):
        flat.add(4, seconds, 4)
    assert flat.fit() == pytest.approx((0.03, 0.0, 1.0)) and flat.per_token(8) == pytest.approx(0.03 / 8)
    curved = StepCostModel()  # a step costs 7 ms at 1 row, 34 ms at 16, not on one line
    for rows, seconds in [(1, 0.007), (2, 0.008), (4, 0.010), (8, 0.018), (16, 0.034)] * 6:
        curved.add(rows, seconds, rows)
    intercept, slope, _ = curved.fit()
    assert intercept + slope < 0.006  # one line through every step misses 1 row by 17%...
    for rows, seconds in [(1, 0.007), (2, 0.008), (8, 0.018), (16, 0.034)]:
        assert rows * curved.per_token(rows) == pytest.approx(seconds, rel=0.03)  # ...the fit around it: < 3%
    falling = StepCostModel()
    falling.add(1, 0.03, 1)
    falling.add(2, 0.01, 2)
    assert falling.fit()[1] == 0.0 and falling.fit()[0] == pytest.approx(0.02)
    # each batch-size bucket keeps its own recent steps: a long spell at 16 rows does not wash out what an 8-row
    # step cost (one window for all sizes held only 16-row steps, and their flat line put an 8-row step at 12 ms)
    held = StepCostModel(window=64)
    for _ in range(3):
        held.add(8, 0.010, 8)
    for _ in range(500):
        held.add(16, 0.012, 16)
    assert held.count_at(8) == 3 and held.count_at(16) == 64 and len(held) == 67
    assert held.per_token(8) == pytest.approx(0.010 / 8) and held.per_token(16) == pytest.approx(0.012 / 16)


def test_adaptive_policy_decides_by_the_cost_model():
    """The plan decides until both modes have MIN_SAMPLES pure steps (the other mode probed every WARMUP_EVERY-th
    step, from the first; where the plan says not to speculate, after every EXPLORE_EVERY steps); then the model's ratio at the CURRENT row count decides, and the other mode is probed
    after every EXPLORE_EVERY steps at a batch size."""
    from types import SimpleNamespace

    import pytest

    batched = SimpleNamespace(draft=object(), rows=[], shape=[3])
    engine = SimpleNamespace(batched=batched, trees_by_batch={2: None})
    sched = Scheduler(engine, max_batch_size=16, speculation="auto")
    try:
        assert sched._choose(4) is True  # no model, no plan against it: draft, and probe AR next
        assert [sched._choose(4) for _ in range(PROBE_STEPS)] == [False] * PROBE_STEPS
        assert sched._choose(4) is True
        assert sched._choose(2) is False  # the plan says no speculation at 2 rows...
        assert not sched._probing.get(2)  # ...and no probe yet: the plan is trusted for EXPLORE_EVERY steps
        sched.step_counts[2] = [EXPLORE_EVERY - 1, 0]
        assert sched._choose(2) is False and sched._probing[2] == PROBE_STEPS
        sched._probing.clear()
        del sched.step_counts[2]
        # AR: 8 ms + 1 ms a row, one token a row; drafting: 9 ms + 2 ms a row, 1.5 tokens a row
        for rows in (3, 4, 3, 5, 7, 6, 9, 15, 12):  # MIN_SAMPLES steps in each of the buckets 3-4, 5-8, 9-16
            sched._measure(False, rows, rows, False, 0.008 + 0.001 * rows)
            sched._measure(True, rows, 1.5 * rows, False, 0.009 + 0.002 * rows)
            # the model decides at a bucket once both modes have MIN_SAMPLES steps there
            count = sched.models["ar"].count_at(bucket(rows))
            assert (sched.predicted_ratio(rows) is None) == (count < MIN_SAMPLES)
        for rows in (3, 8, 16):  # one line per mode through every bucket's steps
            assert sched.predicted_ratio(rows) == pytest.approx((9 + 2 * rows) / (1.5 * (8 + rows)))
        # not where no step ran: a line through other sizes' steps would be an extrapolation
        assert sched.predicted_ratio(1) is None and sched.predicted_ratio(2) is None
        assert "1 rows" not in sched._policy_line()
        # a stall of the process (a cycle 20x its mode's cost) is left out; a step 2x dearer is a cost and stays
        spec = sched.models[((3,), False)]
        sched._measure(True, 15, 1.5 * 15, False, 20 * (0.009 + 0.002 * 15))
        assert len(spec) == 9 and sched.stalls == 1 and "stalls left out: 1" in sched._policy_line()
        sched._measure(True, 15, 1.5 * 15, False, 2 * (0.009 + 0.002 * 15))
        assert len(spec) == 10 and sched.stalls == 1
        # a machine that stays 20x slower is recorded again once the median has followed it
        slow = StepCostModel()
        sched.models[((3,), False)] = slow
        for _ in range(12):
            sched._measure(True, 15, 1.5 * 15, False, 20 * (0.009 + 0.002 * 15))
        assert 0 < len(slow) < 12
        sched.models[((3,), False)] = spec
        spec.by_bucket[16].pop()
        spec._fits.clear()
        spec._array = None
        assert sched.tree_at(2) == (1,) and sched.predicted_ratio(2) is None  # planned none: probes draft [1]
        assert sched.cost_table()[16]["ratio"] == pytest.approx(sched.predicted_ratio(16))
        sched._probing.clear()
        sched.step_counts = {b: [1, 0] for b in (1, 2, 4, 8, 16)}  # no probe starts below
        assert sched._choose(1) is True  # ratio 0.81: drafting pays with one row
        assert sched._choose(5) is True  # 0.97 at 5 rows
        assert sched._choose(7) is False  # 1.02 at 7 rows, in the same bucket
        assert sched._choose(5) is False  # 0.97 again, but back from AR it takes a ratio below SWITCH_MARGIN
        assert sched._choose(1) is True
        assert sched._choose(8) is False and sched._choose(16) is False
        # where the plan says no speculation, the model overrules it only once both modes have steps at that size
        sched.predicted_ratio = lambda rows, greedy=False: 0.5
        assert sched._choose(2) is False
        for _ in range(MIN_SAMPLES):
            sched._measure(False, 2, 2, False, 0.010)
            sched._measure((1,), 2, 3, False, 0.011)
        assert sched._choose(2) is True
        sched._preferred[2] = False
        sched.predicted_ratio = lambda rows, greedy=False: 0.9  # ... and drafting must look
        assert sched._choose(2) is False  # cheaper than AGAINST_PLAN_MARGIN (0.85) to start
        sched.predicted_ratio = lambda rows, greedy=False: 0.8
        assert sched._choose(2) is True
        sched.predicted_ratio = lambda rows, greedy=False: (
            0.88
        )  # ... and below AGAINST_PLAN_KEEP (0.9) to go on
        assert sched._choose(2) is True
        sched.predicted_ratio = lambda rows, greedy=False: 0.93
        assert sched._choose(2) is False
        del sched.predicted_ratio
        # after every EXPLORE_EVERY steps at a batch size (not at its first), PROBE_STEPS of the other mode
        sched.step_counts[16] = [0, 0]
        assert sched._choose(16) is False and not sched._probing.get(16)
        sched.step_counts[16] = [EXPLORE_EVERY - 1, 0]
        assert [sched._choose(16) for _ in range(PROBE_STEPS + 2)] == [False] + [True] * PROBE_STEPS + [False]
        sched._probing.clear()  # (no step ran: the count stayed, and the last call started another probe)
        sched.predicted_ratio = lambda rows, greedy=False: 2.0  # a clear answer: re-checked 4x less often
        sched.step_counts[16] = [EXPLORE_EVERY - 1, 0]
        assert [sched._choose(16) for _ in range(2)] == [False, False]
        sched.step_counts[16] = [4 * EXPLORE_EVERY - 1, 0]
        assert [sched._choose(16) for _ in range(2)] == [False, True]
        sched._probing.clear()
        # where the plan says AR, a model that agrees (0.9: not below AGAINST_PLAN_MARGIN) is a clear answer too
        sched.predicted_ratio = lambda rows, greedy=False: 0.9
        for count, probes in ((EXPLORE_EVERY - 1, False), (4 * EXPLORE_EVERY - 1, True)):
            sched.step_counts[2] = [count, 0]
            assert [sched._choose(2) for _ in range(2)] == [False, probes]
            sched._probing.clear()
        # where the plan drafts, 0.9 is re-checked as usual
        sched.predicted_ratio = lambda rows, greedy=False: 0.9
        sched.step_counts[4] = [EXPLORE_EVERY - 1, 0]
        assert [sched._choose(4) for _ in range(2)] == [True, False]
    finally:
        sched.close()


def test_greedy_batches_draft_the_greedy_plan():
    """decode.tree=auto plans greedy rows apart (their acceptance is higher): a batch of greedy rows drafts the
    greedy plan's tree, a batch with any sampled row the sampled plan's; each has its own cost model."""
    from types import SimpleNamespace

    class Batch:
        draft, shape = object(), [1, 1, 1]

        def __init__(self):
            self.rows, self.flags = [SimpleNamespace(greedy=True), SimpleNamespace(greedy=True)], []

        def step(self, flags):
            self.flags.append(flags)
            return [(r, [7, 7]) for r in self.rows]

    batched = Batch()
    engine = SimpleNamespace(
        batched=batched, trees_by_batch={1: [1, 1, 1], 2: None}, greedy_trees_by_batch={1: [3], 2: [2, 1]}
    )
    sched = Scheduler(engine, max_batch_size=4, speculation="auto")
    try:
        assert sched.tree_at(1, greedy=True) == (3,) and sched.tree_at(1) == (1, 1, 1)
        assert sched.tree_at(2, greedy=True) == (2, 1) and sched.tree_at(2) == (1,)  # planned none: probe [1]
        sched._probing[2] = 0
        sched.step_counts[2] = [1, 0]  # no probe starts at the next step
        sched._pure = None
        sched._batch_step()
        assert batched.flags[-1] == (2, 1) and sched._pure[3] is True
        sched._measure(*sched._pure, 0.01)
        batched.rows[1].greedy = False  # one sampled row: the sampled plan, which says AR at 2 rows
        sched._batch_step()
        assert batched.flags[-1] is False
        assert ((2, 1), True) in sched.models and not any(k[1] is False for k in sched.models if k != "ar")
    finally:
        sched.close()


def test_adaptive_policy_measures_only_pure_steps_that_do_not_catch_up():
    """A pure step is measured over its whole cycle (admission, step, hand-off). A drafting step after a step with
    AR rows feeds the draft what they skipped: not measured; nor is a cycle that admitted a whole wave. A
    newcomer's target prefill is left out of the cycle's time."""
    import time
    from types import SimpleNamespace

    class Batch:
        draft, shape = object(), [3]

        def __init__(self):
            self.rows = [SimpleNamespace(greedy=False), SimpleNamespace(greedy=False)]

        def step(self, flag):
            return [(r, [7] * (2 if flag else 1)) for r in self.rows]

    batched = Batch()
    engine = SimpleNamespace(batched=batched, trees_by_batch={})
    sched = Scheduler(engine, max_batch_size=4, speculation="auto")
    try:
        modes = iter([False, True, True, False, True, True, True])
        sched._choose = lambda rows, greedy: next(modes)
        sched._step = sched._batch_step
        for _ in range(3):  # AR, drafting (catch-up), drafting
            sched._cycle()
        assert len(sched.models["ar"]) == 1 and len(sched.models[((3,), False)]) == 1
        sched._cycle()  # AR
        sched._cycle()  # drafting after an AR step
        assert len(sched.models["ar"]) == 2 and len(sched.models[((3,), False)]) == 1
        sched._admit = lambda: 2  # a wave admitted at once: its prefills are not a step's cost
        sched._cycle()
        assert len(sched.models["ar"]) == 2 and len(sched.models[((3,), False)]) == 1
        assert sched.cost_table()[2]["drafted"] == 4 / 6  # steps in which the rows drafted

        def admit_one():  # a newcomer whose target prefill took 200 ms (as _start records it)
            time.sleep(0.2)
            sched._prefill_seconds += 0.2
            return 1

        sched._admit = admit_one
        sched._cycle()  # both modes pay the prefill alike: it is left out of the drafting step's cost
        assert len(sched.models[((3,), False)]) == 2 and sched.models[((3,), False)].array[-1, 1] < 0.1
    finally:
        sched.close()


def test_in_process_modes_are_chosen_by_name():
    import pytest

    assert select_modes([]) == serving_modes()
    assert list(select_modes(["batched adaptive", "batched AR"])) == ["batched AR", "batched adaptive"]
    with pytest.raises(UnknownModeError, match="batched ar"):
        select_modes(["batched ar"])


def test_newcomers_are_prefilled_together_in_blocks():
    """Waiting requests join in one prefill forward each block (add_many) of at most max_prefill_tokens prompt
    tokens (at least one request): every block when nothing runs, one block per step boundary while others run,
    never past max_batch_size; when a block fails, its requests are admitted one by one and only the bad one
    fails."""
    import threading
    from types import SimpleNamespace

    calls = []

    class Batch:
        draft = None
        rows: list = []

        def add_many(self, requests):
            calls.append(len(requests))
            if any(r["prompt_ids"][0] == -1 for r in requests):
                raise ValueError("bad prompt")
            return [SimpleNamespace(finished=False, stats=DecodeStats()) for _ in requests]

    params = SimpleNamespace(max_new_tokens=4, temperature=0.0, top_p=1.0, top_k=0, stop=None, logprobs=None)
    engine = SimpleNamespace(batched=Batch(), generator=lambda p: None, eos=lambda p: [])
    sched = Scheduler(engine, max_batch_size=8, max_prefill_tokens=25)
    sched.close()  # no decode thread: _admit is driven by hand below

    def job(first=1):
        return SimpleNamespace(
            prompt_ids=[first] * 10,
            params=params,
            cancelled=threading.Event(),
            finish=lambda: None,
            _put=lambda item: None,
            error=None,
        )

    sched.waiting.extend(job() for _ in range(5))
    assert sched._admit() == 5 and calls == [2, 2, 1]  # nothing ran: every block at once
    calls.clear()
    sched.waiting.extend(job() for _ in range(4))
    assert sched._admit() == 2 and calls == [2]  # others run: one block per step boundary
    assert sched._admit() == 1 and calls == [2, 1]  # ... and never past max_batch_size (8)
    assert len(sched.waiting) == 1 and sched.num_running == 8
    sched.tasks.clear()
    sched.waiting.clear()
    calls.clear()
    bad, good = job(first=-1), job()
    sched.waiting.extend([job(), bad, good])
    sched.tasks.append(SimpleNamespace())  # one running request
    assert sched._admit() == 2 and calls == [2, 1, 1]  # the block failed: one by one
    assert isinstance(bad.error, ValueError) and sched.num_running == 2
    assert sched._admit() == 1 and good.error is None
    import pytest

    with pytest.raises(ValueError, match="max_prefill_tokens"):
        Scheduler(engine, max_batch_size=8, max_prefill_tokens=0)


def test_a_long_newcomer_is_prefilled_in_parts_while_others_run():
    """Chunked prefill: while others run, a newcomer longer than prefill_chunk_tokens is prefilled one part per
    step boundary (prefill_part) and joins with its last part; the requests behind it wait their turn; with
    nothing running, or with chunking off, it joins at once; a cancelled one drops its part, and a failing part
    fails only its request."""
    import threading
    from types import SimpleNamespace

    log = []

    class Batch:
        draft = None
        rows: list = []

        def prefill_part(self, prompt, tokens, part=None):
            if prompt[0] == -1:
                raise ValueError("bad prompt")
            part = part or SimpleNamespace(done=0, seconds={"target": 0.0}, prompt=prompt)
            part.done = min(part.done + tokens, len(prompt) - 1)
            part.remaining = len(prompt) - 1 - part.done
            log.append(("part", len(prompt), part.done))
            return part

        def add_many(self, requests):
            log.append(("join", [len(r["prompt_ids"]) for r in requests], [r["partial"] for r in requests]))
            return [SimpleNamespace(finished=False, stats=DecodeStats()) for _ in requests]

    params = SimpleNamespace(max_new_tokens=4, temperature=0.0, top_p=1.0, top_k=0, stop=None, logprobs=None)
    engine = SimpleNamespace(batched=Batch(), generator=lambda p: None, eos=lambda p: [])
    sched = Scheduler(engine, max_batch_size=8, prefill_chunk_tokens=10)
    sched.close()  # no decode thread: _admit is driven by hand below
    finished = []

    def job(n, first=1):
        j = SimpleNamespace(
            prompt_ids=[first] * n,
            params=params,
            cancelled=threading.Event(),
            _put=lambda item: None,
            error=None,
        )
        j.finish = lambda: finished.append(j)
        return j

    long, short = job(26), job(5)
    sched.waiting.extend([long, short])
    sched.tasks.append(SimpleNamespace())  # one running request
    assert sched._admit() == 0 and log == [("part", 26, 10)]  # one part per step boundary
    assert sched._admit() == 0 and log[-1] == ("part", 26, 20)  # the short one waits behind it
    assert (
        sched._admit() == 2
    )  # 5 tokens left (and the root): it joins with its part, the short one beside it
    assert log[-1][:2] == ("join", [26, 5]) and log[-1][2][0].done == 20 and log[-1][2][1] is None
    assert sched._part is None
    log.clear()
    sched.tasks.clear()
    sched.waiting.append(job(26))  # nothing runs: no one to stall, one prefill
    assert sched._admit() == 1 and log == [("join", [26], [None])]
    log.clear()
    gone, bad, after = job(26), job(26, first=-1), job(3)
    sched.waiting.extend([gone, bad, after])
    sched.tasks.append(SimpleNamespace())
    assert sched._admit() == 0 and sched._part[0] is gone
    gone.cancelled.set()
    assert sched._admit() == 0 and gone in finished and sched._part is None  # its part is dropped
    assert isinstance(bad.error, ValueError) and bad in finished and list(sched.waiting) == [after]
    assert sched._admit() == 1 and log[-1] == ("join", [3], [None])
    off = Scheduler(engine, max_batch_size=8, prefill_chunk_tokens=0)
    off.close()
    log.clear()
    off.tasks.append(SimpleNamespace())
    off.waiting.append(job(26))
    assert off._admit() == 1 and log == [("join", [26], [None])]
    import pytest

    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        Scheduler(engine, max_batch_size=8, prefill_chunk_tokens=-1)


def test_no_drafting_probe_breaks_a_batch_in_lockstep():
    """Where the plan says not to speculate, a drafting probe waits while the rows are in lockstep (it would
    stagger them for good); a staggered batch is probed as before, and AR probes where the plan drafts are not
    held back (an AR step staggers nothing)."""
    from types import SimpleNamespace

    batched = SimpleNamespace(draft=object(), rows=[], shape=[3], in_lockstep=True)
    engine = SimpleNamespace(batched=batched, trees_by_batch={16: None, 4: [2, 1]})
    sched = Scheduler(engine, max_batch_size=16, speculation="auto")
    try:
        sched.step_counts[16] = [EXPLORE_EVERY - 1, 0]
        assert sched._choose(16) is False and not sched._probing.get(16)  # in lockstep: no probe
        batched.in_lockstep = False
        assert sched._choose(16) is False and sched._probing[16] == PROBE_STEPS  # staggered: probed
        assert sched._choose(16) is True
        batched.in_lockstep = True
        assert sched._choose(4) is True and sched._probing[4] == PROBE_STEPS  # the plan drafts: AR probe
        assert sched._choose(4) is False
    finally:
        sched.close()

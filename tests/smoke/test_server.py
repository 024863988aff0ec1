"""The OpenAI-compatible server end to end: `serve/server.py` in a subprocess on the micro world, real HTTP calls
with httpx and the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import pytest
import torch

from resispec.benchmark.config import BenchConfig
from resispec.benchmark.load import run_load_test
from resispec.decoding import SpeculativeDecoder
from resispec.serving.text import decode_ids, encode_chat, encode_text

ROOT = Path(__file__).resolve().parents[2]
KEY = "test-key"
MODEL = "micro"
RULE, TREE = "resispec", [2, 1]
PROMPTS = ["def main():\n", "import os\n", "class Foo:\n    def ", "for i in range(", "return self."]
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server, headers=HEADERS, timeout=60) as c:
        yield c


@pytest.fixture()
def oai(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _metrics(client) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in client.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _metric(m: dict, prefix: str, **labels) -> float:
    """Sum of the samples named `prefix` whose labels include `labels`."""
    total = 0.0
    for key, value in m.items():
        name = key.split("{", 1)[0]
        if name == prefix and all(f'{k}="{v}"' in key for k, v in labels.items()):
            total += value
    return total


def _sse(response) -> list[dict]:
    events, done = [], False
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        if data == "[DONE]":
            done = True
            continue
        assert not done, "data after [DONE]"
        events.append(json.loads(data))
    assert done, "stream did not end with data: [DONE]"
    return events


def test_greedy_completion_equals_decoder(client, oai, pair):
    target, draft, tok = pair
    dec = SpeculativeDecoder(target, draft, rule=RULE, tree=TREE, tokenizer=tok)
    for prompt in PROMPTS[:2]:
        ids = encode_text(tok, prompt)
        out = dec.generate(torch.tensor([ids]), max_new_tokens=16, temperature=0.0, eos_token_id=[])
        expected = decode_ids(tok, out.sequences[0, len(ids) :].tolist())
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        res = r.json()
        assert res["object"] == "text_completion" and res["model"] == MODEL
        assert res["choices"][0]["text"] == expected
        assert res["choices"][0]["finish_reason"] == "length"
        usage = {k: v for k, v in res["usage"].items() if k != "prompt_tokens_details"}  # cached or not
        assert usage == {
            "prompt_tokens": len(ids),
            "completion_tokens": 16,
            "total_tokens": len(ids) + 16,
        }
        # the official client, same request
        c = oai.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        assert c.choices[0].text == expected and c.usage.completion_tokens == 16


def test_stream_reassembles_to_non_streamed(client, oai, pair):
    tok = pair[2]
    prompt = PROMPTS[2]
    base = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 20,
        "temperature": 1.0,
        "seed": 7,
        "ignore_eos": True,
    }
    full = client.post("/v1/completions", json=base).json()
    with client.stream(
        "POST", "/v1/completions", json={**base, "stream": True, "stream_options": {"include_usage": True}}
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _sse(r)
    assert all(e["object"] == "text_completion" for e in events)
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == full["choices"][0]["text"]  # same seed -> same sample, and the deltas reassemble
    assert events[-1]["choices"] == []
    # the same prompt again: its K/V comes from the prefix cache, all but its last token, and usage says so
    streamed = dict(events[-1]["usage"])
    assert streamed.pop("prompt_tokens_details") == {"cached_tokens": full["usage"]["prompt_tokens"] - 1}
    assert streamed == {k: v for k, v in full["usage"].items() if k != "prompt_tokens_details"}
    assert [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]][0]["choices"][0][
        "finish_reason"
    ] == "length"
    assert full["usage"]["prompt_tokens"] == len(encode_text(tok, prompt))
    # openai client streaming
    stream = oai.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=20,
        temperature=1.0,
        seed=7,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == full["choices"][0]["text"]


def test_chat_with_openai_client(oai, pair):
    tok = pair[2]
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "def add(a, b):"},
    ]
    r = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(encode_chat(tok, [(m["role"], m["content"]) for m in messages]))
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    )
    assert (
        chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    )


def test_stop_string_ends_text(client):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert len(text) > 4
    stop = text[2:4]  # a stop string that surely occurs
    r = client.post("/v1/completions", json={**body, "stop": [stop]}).json()
    assert r["choices"][0]["text"] == text[: text.index(stop)] and r["choices"][0]["finish_reason"] == "stop"
    with client.stream("POST", "/v1/completions", json={**body, "stop": stop, "stream": True}) as resp:
        streamed = "".join(c["text"] for e in _sse(resp) for c in e["choices"])
    assert streamed == r["choices"][0]["text"]


def test_models_health_and_auth(server, client):
    assert httpx.get(server + "/health").status_code == 200  # open without a key
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    good = {"model": MODEL, "prompt": "x = ", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server + "/v1/completions", json=good, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server + "/v1/models").status_code == 401
    assert client.post("/v1/completions", json=good).status_code == 200


BAD = {
    "malformed json": ("/v1/completions", b'{"model": "micro", "prompt": ', 400),
    "unknown model": ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404),
    "negative max_tokens": ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -5}, 400),
    "prompt over context": ("/v1/completions", {"model": MODEL, "prompt": "token " * 3000}, 400),
    "max_tokens over context": ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**6}, 400),
    "wrong type max_tokens": ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "lots"}, 400),
    "wrong type prompt": ("/v1/completions", {"model": MODEL, "prompt": 3.5}, 400),
    "missing prompt": ("/v1/completions", {"model": MODEL}, 400),
    "temperature out of range": ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 9}, 400),
    "chat wrong type": ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}, 400),
    "chat bad role": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
        400,
    ),
    "chat unknown model": (
        "/v1/chat/completions",
        {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
        404,
    ),
    "json array body": ("/v1/completions", [1, 2, 3], 400),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gets_4xx_and_server_keeps_serving(client, case):
    path, body, status = BAD[case]
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    ok = client.post("/v1/completions", json={"model": MODEL, "prompt": "x = ", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_metrics_counters_increase(client):
    before = _metrics(client)
    body = {
        "model": MODEL,
        "prompt": PROMPTS[3],
        "max_tokens": 16,
        "temperature": 1.0,
        "seed": 1,
        "ignore_eos": True,
    }
    assert client.post("/v1/completions", json=body).status_code == 200
    after = _metrics(client)
    d = {
        k: _metric(after, k) - _metric(before, k)
        for k in (
            "resispec:spec_decode_num_drafts_total",
            "resispec:spec_decode_num_draft_tokens_total",
            "resispec:spec_decode_num_accepted_tokens_total",
            "resispec:spec_decode_num_accepted_tokens_per_pos_total",
            "resispec:generation_tokens_total",
            "resispec:time_to_first_token_seconds_count",
            "resispec:e2e_request_latency_seconds_count",
        )
    }
    assert d["resispec:generation_tokens_total"] == 16
    assert d["resispec:spec_decode_num_drafts_total"] >= 1
    # one step emits accepted + 1 tokens, and the last step may be cut by max_tokens
    assert (
        d["resispec:spec_decode_num_drafts_total"] + d["resispec:spec_decode_num_accepted_tokens_total"] >= 16
    )
    assert d["resispec:spec_decode_num_draft_tokens_total"] >= d[
        "resispec:spec_decode_num_drafts_total"
    ] * len(TREE)
    assert (
        d["resispec:spec_decode_num_accepted_tokens_per_pos_total"]
        == d["resispec:spec_decode_num_accepted_tokens_total"]
    )
    assert (
        d["resispec:time_to_first_token_seconds_count"] == 1
        and d["resispec:e2e_request_latency_seconds_count"] == 1
    )
    # per position: a draft token at depth d+1 is accepted only if depth d was, so the counts never grow with depth
    per_pos = [
        _metric(after, "resispec:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
        - _metric(before, "resispec:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
        for i in range(len(TREE))
    ]
    assert per_pos == sorted(per_pos, reverse=True), per_pos
    assert sum(per_pos) == d["resispec:spec_decode_num_accepted_tokens_total"]
    assert re.search(r'resispec:request_success_total\{finished_reason="length"', client.get("/metrics").text)


def test_twenty_concurrent_clients(server, client):
    prompts = PROMPTS[:4]
    expected = {}
    for p in prompts:
        r = client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True},
        )
        expected[p] = r.json()["choices"][0]["text"]

    async def one(ac: httpx.AsyncClient, i: int) -> tuple[str, str]:
        p = prompts[i % len(prompts)]
        body = {"model": MODEL, "prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        if i % 2:  # half of them stream
            async with ac.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                text = ""
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
                return p, text
        r = await ac.post("/v1/completions", json=body)
        return p, r.json()["choices"][0]["text"]

    async def main():
        async with httpx.AsyncClient(base_url=server, headers=HEADERS, timeout=120) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(20)))

    results = asyncio.run(main())
    assert len(results) == 20
    for p, text in results:
        assert text == expected[p]


def test_disconnect_mid_stream_frees_the_slot(server, client):
    before = _metrics(client)
    max_tokens = client.get("/v1/models").json()["data"][0]["max_model_len"] - 16
    body = {
        "model": MODEL,
        "prompt": "x = 1\n",
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=server, headers=HEADERS, timeout=60) as c2:
        with c2.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    break  # got some text: hang up now
    # the next request is served, and the abandoned generation stops early (fewer tokens than asked, below)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "y", "max_tokens": 2})
    assert r.status_code == 200
    deadline = time.time() + 60  # a poll, not a speed bound: the abort is counted within a few steps
    while time.time() < deadline:
        m = _metrics(client)
        if _metric(m, "resispec:request_success_total", finished_reason="abort") > _metric(
            before, "resispec:request_success_total", finished_reason="abort"
        ):
            break
        time.sleep(0.2)
    assert (
        _metric(m, "resispec:request_success_total", finished_reason="abort")
        == _metric(before, "resispec:request_success_total", finished_reason="abort") + 1
    )
    generated = _metric(m, "resispec:generation_tokens_total") - _metric(
        before, "resispec:generation_tokens_total"
    )
    assert generated < max_tokens  # the generation stopped early
    assert _metric(m, "resispec:num_requests_running") == 0


def test_bench_load_test_mode(server):
    bench = BenchConfig(concurrency=4, num_requests=8, max_new_tokens=8, temperatures=[1.0])
    res = run_load_test(server, PROMPTS, bench, api_key=KEY, show=False)
    assert res.num_ok == 8 and res.num_failed == 0 and res.model == MODEL
    assert res.completion_tokens <= 8 * 8 and res.tokens_per_second > 0
    assert res.latency_p50 <= res.latency_p95 and res.server_tau is not None
    assert 1.0 <= res.server_tau <= 1 + len(TREE)  # tokens per verify forward: at most every level accepted

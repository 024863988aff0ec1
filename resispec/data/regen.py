"""Target regeneration: the target's own responses to a prompt set (on-policy data), cached as a `datasets`
dataset with metadata (target id, weight fingerprint, sampling settings, prompt-set hash); optionally mixed with
the draft's own responses (on-policy for the draft, `mix_draft_responses`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import datasets
import torch
from tqdm.auto import tqdm

from resispec.data.config import DataConfig, RegenConfig
from resispec.data.prompts import load_prompts
from resispec.models.config import WorldConfig
from resispec.models.eos import model_eos, normalize_eos
from resispec.models.world import cache_root
from resispec.vllm_venv import offline_generate

REGEN_FORMAT = 1


def prompt_set_hash(prompts: datasets.Dataset) -> str:
    """Hash of every prompt's token ids, in order."""
    h = hashlib.sha256()
    for ids in prompts["prompt_ids"]:
        h.update(json.dumps(list(ids)).encode())
        h.update(b";")
    return h.hexdigest()[:16]


@torch.no_grad()
def weights_fingerprint(model: torch.nn.Module, numel: int = 4096) -> str:
    """Cheap fingerprint of a model's weights: names, shapes and the first values of every tensor.

    Catches a retrained checkpoint at the same path, which the path alone would not."""
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(f"{name}{tuple(p.shape)}".encode())
        h.update(p.detach().flatten()[:numel].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def files_fingerprint(model_dir: str) -> str:
    """Fingerprint of a model's weights from its files, without loading them (the vLLM engine's key: no HF copy
    is ever loaded on that path): each *.safetensors file's name, size, header (tensor names, dtypes, shapes)
    and first 64 KiB of data. A hub name (no local folder) stands for itself."""
    h = hashlib.sha256()
    folder = Path(model_dir).expanduser()
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        h.update(f"name:{model_dir}".encode())
    for path in files:
        with open(path, "rb") as f:
            header = f.read(int.from_bytes(f.read(8), "little"))
            h.update(f"{path.name}:{path.stat().st_size}".encode() + header + f.read(65536))
    return h.hexdigest()[:16]


def eos_ids(tokenizer, target=None, model_dir: str | None = None) -> list[int]:
    """Every id that ends a response: the tokenizer's eos first, then the generation config's (Llama 3 stops at
    <|eot_id|>, <|end_of_text|> and <|eom_id|>, as HF generate and vLLM do)."""
    gen = model_eos(target) if target is not None else None
    if gen is None and model_dir:
        try:
            from transformers import GenerationConfig

            gen = GenerationConfig.from_pretrained(model_dir).eos_token_id
        except (OSError, ValueError):  # no generation_config.json: the tokenizer's eos alone
            gen = None
    first = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return first + sorted(normalize_eos(gen) - set(first))


def _cut_at_eos(row: list[int], eos: list[int]) -> list[int] | None:
    """row cut after its first eos (kept: the draft must learn to stop too), None when it has none."""
    ends = [row.index(e) for e in eos if e in row]
    return row[: min(ends) + 1] if ends else None


def _generate_batch(
    target, prompt_lists: list[list[int]], regen: RegenConfig, pad_id: int, eos_id: int | list[int] | None
):
    """Left-padded batched sampling with HF generate. -> responses, each cut after its first eos (any of eos_id)."""
    eos = [] if eos_id is None else [eos_id] if isinstance(eos_id, int) else list(eos_id)
    device = next(target.parameters()).device
    width = max(len(p) for p in prompt_lists)
    input_ids = torch.full((len(prompt_lists), width), pad_id, dtype=torch.long)  # [B, P]
    attention_mask = torch.zeros_like(input_ids)  # [B, P]
    for i, ids in enumerate(prompt_lists):
        input_ids[i, width - len(ids) :] = torch.tensor(ids)
        attention_mask[i, width - len(ids) :] = 1
    greedy = regen.temperature <= 0
    # top_k=0 / top_p=1 switch those filters off (None would fall back to generation_config.top_k = 50)
    kwargs = {} if greedy else {"temperature": regen.temperature, "top_p": regen.top_p, "top_k": regen.top_k}
    out = target.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        do_sample=not greedy,
        max_new_tokens=regen.max_new_tokens,
        pad_token_id=pad_id,
        eos_token_id=eos or None,
        **kwargs,
    )  # [B, P + new]
    responses = []
    for row in out[:, width:].tolist():
        cut = _cut_at_eos(row, eos)
        if cut is not None:
            row = cut
        elif pad_id not in eos:
            while row and row[-1] == pad_id:
                row.pop()
        responses.append(row)
    return responses


def _regen_key(regen: RegenConfig) -> dict:
    """The sampling settings in the cache key; the built-in engine keeps the keys it had before `engine` existed."""
    d = asdict(regen)
    if d.get("engine") == "hf":
        d.pop("engine")
    return d


def _model_dir(target) -> str:
    return str(getattr(target.config, "_name_or_path", "") or getattr(target, "name_or_path", ""))


def _vllm_responses(
    model_dir: str, prompt_lists: list[list[int]], regen: RegenConfig, eos_id: int | list[int] | None
):
    """All responses from vLLM's offline API (continuous batching decides the batches). With CUDA: one engine per
    visible GPU, each on a contiguous share of the prompts (data parallel: vLLM's LLM class refuses
    data_parallel_size in one process), CUDA graphs on; on the CPU one engine in float32."""
    from concurrent.futures import ThreadPoolExecutor

    sampling = (regen.max_new_tokens, regen.temperature, regen.top_p, regen.top_k)
    if not torch.cuda.is_available():
        return offline_generate(model_dir, prompt_lists, *sampling, regen.seed, eos_id, "float32")[
            "responses"
        ]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    n = max(1, min(len(devices), len(prompt_lists)))
    bounds = [(i * len(prompt_lists) // n, (i + 1) * len(prompt_lists) // n) for i in range(n)]

    def share(i: int) -> list[list[int]]:
        lo, hi = bounds[i]
        out = offline_generate(
            model_dir,
            prompt_lists[lo:hi],
            *sampling,
            regen.seed + i,  # each engine its own sample streams
            eos_id,
            "auto",
            engine_args={"enforce_eager": False},
            env={"CUDA_VISIBLE_DEVICES": devices[i]},
        )
        return out["responses"]

    with ThreadPoolExecutor(n) as pool:
        return [r for part in pool.map(share, range(n)) for r in part]


def _regen_meta(target, tokenizer, prompts, regen: RegenConfig, target_id: str, model_dir: str | None):
    """(cache meta, the eos ids that end a response): the key covers the target (id + weight fingerprint), the
    sampling settings, the prompt-set hash and, when there are several, the eos ids."""
    vllm = regen.engine == "vllm"
    meta = {
        "format": REGEN_FORMAT,
        "target_id": target_id or model_dir or _model_dir(target),
        "weights": files_fingerprint(model_dir) if vllm else weights_fingerprint(target),
        "regen": _regen_key(regen),
        "prompt_set_hash": prompt_set_hash(prompts),
        "num_prompts": len(prompts),
    }
    stops = eos_ids(tokenizer, target, model_dir)
    if len(stops) > 1:  # several eos ids change the responses; a single one keeps the keys cached sets have
        meta["eos_ids"] = stops
    return meta, stops


def _responses(target, tokenizer, prompt_ids, indices, regen: RegenConfig, model_dir, stops, bar) -> list:
    """[(prompt index, response ids)] of this process's `indices`, longest prompts first."""
    order = sorted(indices, key=lambda i: -len(prompt_ids[i]))  # similar lengths share a batch: less padding
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    results: list[tuple[int, list[int]]] = []
    if regen.engine == "vllm":  # one call: vLLM's continuous batching decides the batches
        if order:
            responses = _vllm_responses(model_dir, [list(prompt_ids[i]) for i in order], regen, stops)
            results.extend(zip(order, responses, strict=True))
        bar.update(len(order))
    elif regen.engine == "hf":
        for b in range(0, len(order), regen.batch_size):
            batch = order[b : b + regen.batch_size]
            torch.manual_seed(regen.seed * 1_000_003 + batch[0])
            responses = _generate_batch(target, [list(prompt_ids[i]) for i in batch], regen, pad_id, stops)
            results.extend(zip(batch, responses, strict=True))
            bar.update(len(batch))
    else:
        raise ValueError(f"data.regen.engine must be hf or vllm, got {regen.engine!r}")
    return results


def _save_regenerated(
    folder: Path, meta: dict, prompt_ids, results, seconds: float, num_processes: int
) -> None:
    """The dataset and its meta.json written to a temporary folder, then renamed into place."""
    out = datasets.Dataset.from_dict(
        {"prompt_ids": [list(prompt_ids[i]) for i, _ in results], "response_ids": [r for _, r in results]}
    )
    tmp = folder.parent / f"{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    out.save_to_disk(str(tmp / "dataset"))
    record = {
        **meta,
        "seconds": round(seconds, 1),
        "num_processes": num_processes,
        "response_tokens": int(sum(len(r) for _, r in results)),
    }
    (tmp / "meta.json").write_text(json.dumps(record, indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def regenerate(
    target,
    tokenizer,
    prompts: datasets.Dataset,
    regen: RegenConfig,
    cache_dir: str | Path,
    accelerator=None,
    target_id: str = "",
    progress: bool = True,
    model_dir: str | None = None,
) -> datasets.Dataset:
    """Responses of the target to every prompt -> Dataset(prompt_ids, response_ids), cached under cache_dir.

    The cache key covers the target (id + weight fingerprint), the sampling settings and the prompt-set hash, so
    a cached set is reused only when nothing changed. Under accelerate the prompts are split across processes,
    gathered, and saved by the main process. Batches are seeded from regen.seed and their first prompt's index.

    regen.engine=vllm: `target` may be None (then `model_dir` names the weights): vLLM runs on the main process
    only, over every GPU (`_vllm_responses`), while the others wait; the key's fingerprint is read from the
    weight files (`files_fingerprint`), so a run that never loads the HF model finds the same cache."""
    vllm = regen.engine == "vllm"
    if vllm:
        model_dir = model_dir or _model_dir(target)
    elif target is None:
        raise ValueError("regeneration with data.regen.engine=hf needs the loaded target")
    meta, stops = _regen_meta(target, tokenizer, prompts, regen, target_id, model_dir)
    key = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]
    folder = Path(cache_dir).expanduser() / f"regen-{key}"
    if (folder / "meta.json").exists():
        return datasets.load_from_disk(str(folder / "dataset"))

    is_main = accelerator is None or accelerator.is_main_process
    num_processes = accelerator.num_processes if accelerator is not None else 1
    indices = list(range(len(prompts)))
    if vllm and not is_main:
        indices = []  # one vLLM run (the main process's, spread over the GPUs); the others wait for it
    elif not vllm and num_processes > 1:
        with accelerator.split_between_processes(indices) as mine:
            indices = list(mine)
    prompt_ids = prompts["prompt_ids"]
    start = time.perf_counter()
    bar = tqdm(total=len(indices), desc="regenerate", disable=not (progress and is_main), dynamic_ncols=True)
    results = _responses(target, tokenizer, prompt_ids, indices, regen, model_dir, stops, bar)
    bar.close()
    if num_processes > 1:
        from accelerate.utils import gather_object

        results = gather_object(results)
    results = sorted(results, key=lambda r: r[0])
    if is_main:
        _save_regenerated(folder, meta, prompt_ids, results, time.perf_counter() - start, num_processes)
    if accelerator is not None:
        accelerator.wait_for_everyone()
    return datasets.load_from_disk(str(folder / "dataset"))


def data_cache_dir(data: DataConfig, world: WorldConfig | None = None) -> Path:
    """data.cache_dir, else `<world cache>/data`."""
    if data.cache_dir:
        return Path(data.cache_dir).expanduser()

    return cache_root(world) / "data"


def ensure_regenerated(
    data: DataConfig,
    target,
    tokenizer,
    split: str = "train",
    world: WorldConfig | None = None,
    accelerator=None,
    target_id: str = "",
    progress: bool = True,
    draft=None,
    model_dir: str | None = None,
) -> datasets.Dataset:
    """Prompts of a split with responses: the target's (data.responses = regenerate, cached) or the source's own
    (data.responses = fixed). With `draft` and data.draft_fraction > 0, that fraction of the training prompts
    gets the draft's responses instead (`mix_draft_responses`). target None + model_dir: the vLLM engine without
    an HF copy of the target (see `regenerate`). -> Dataset(prompt_ids, response_ids)."""

    prompts = load_prompts(data, tokenizer, split, world)
    if data.responses == "fixed":
        if "reference_ids" not in prompts.column_names:
            raise ValueError(f"data.responses=fixed but source {data.source!r} has no responses")
        out = prompts.rename_column("reference_ids", "response_ids")
        out = out.select_columns(["prompt_ids", "response_ids"])
        return out.filter(lambda r: len(r["response_ids"]) > 0)
    if data.responses != "regenerate":
        raise ValueError(f"data.responses must be regenerate or fixed, got {data.responses!r}")
    prompts = prompts.select_columns(["prompt_ids"])
    rows = regenerate(
        target,
        tokenizer,
        prompts,
        data.regen,
        data_cache_dir(data, world),
        accelerator,
        target_id,
        progress,
        model_dir,
    )
    if draft is None or data.draft_fraction <= 0 or split != "train":
        return rows
    return mix_draft_responses(
        rows, draft, tokenizer, data, data_cache_dir(data, world), accelerator, progress
    )


def mix_draft_responses(
    rows: datasets.Dataset,
    draft,
    tokenizer,
    data: DataConfig,
    cache_dir: str | Path,
    accelerator=None,
    progress: bool = True,
) -> datasets.Dataset:
    """Replace the responses of a seeded data.draft_fraction of the rows by the draft's own samples (the same
    regen settings, cached by the draft's weights like any regeneration). The loss still compares p and q at
    every position, so these rows teach the draft on the prefixes it will actually produce: the student-generated
    data of GKD (Agarwal et al. 2024) and DistillSpec (Zhou et al. 2024), mixed with target regenerations at
    the given ratio. The draft samples once, before training (its initial policy), not after every update."""
    if not 0.0 <= data.draft_fraction <= 1.0:
        raise ValueError(f"data.draft_fraction must be in [0, 1], got {data.draft_fraction}")
    g = torch.Generator().manual_seed(data.regen.seed)
    num = round(data.draft_fraction * len(rows))
    picked = sorted(torch.randperm(len(rows), generator=g)[:num].tolist())
    if not picked:
        return rows
    prompts = rows.select(picked).select_columns(["prompt_ids"])
    drafted = regenerate(draft, tokenizer, prompts, data.regen, cache_dir, accelerator, "draft", progress)
    responses = list(rows["response_ids"])
    for i, r in zip(picked, drafted["response_ids"], strict=True):
        responses[i] = list(r)
    return datasets.Dataset.from_dict({"prompt_ids": list(rows["prompt_ids"]), "response_ids": responses})

"""The embedded tiny world: stdlib text, a local BPE tokenizer, a small Llama target and a smaller draft.

Built once per config and cached under `<cache>/<name>-<confighash>/` (cache = world.cache_dir, else
$RESISPEC_CACHE, else ~/.cache/resispec). `report.json` in that folder marks a finished build.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from resispec.models.config import WorldConfig
from resispec.models.factory import grow_depth, make_llama, num_params, train_bpe_tokenizer
from resispec.models.pretraining import (
    eval_windows,
    forward_ms,
    generate_samples,
    heldout_loss,
    step_seconds,
    train_lm,
    unigram_loss,
)

WORLD_FORMAT = 1  # bump when the build changes in a way that invalidates cached worlds
SPLITS = ("train", "validation", "test")
SPLIT_FRACTIONS = (0.90, 0.05, 0.05)
# Folders that are not ordinary library code (tests, generated tables, docs blobs, third-party packages).
SKIP_DIRS = {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idle_test",
    "__pycache__",
    "encodings",
    "lib-dynload",
    "pydoc_data",
    "ensurepip",
}
MAX_FILE_BYTES = 400_000
NUM_SAMPLES = 3


@dataclass
class WorldPaths:
    """Where a built world lives, and its report (losses, perplexities, forward times, samples)."""

    root: Path
    tokenizer_dir: Path
    target_dir: Path
    draft_dir: Path
    splits_dir: Path
    report: dict = field(default_factory=dict)


def cache_root(world: WorldConfig | None = None) -> Path:
    """world.cache_dir, else $RESISPEC_CACHE, else ~/.cache/resispec."""
    if world is not None and world.cache_dir:
        return Path(world.cache_dir).expanduser()
    env = os.environ.get("RESISPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "resispec"


def config_hash(world: WorldConfig) -> str:
    """Hash of everything that changes the built world (not where it is cached)."""
    spec = asdict(world)
    spec.pop("cache_dir", None)
    spec.pop("num_threads", None)  # changes speed, not the result
    spec["format"] = WORLD_FORMAT
    spec["python"] = (
        f"{sys.version_info.major}.{sys.version_info.minor}"  # the stdlib text differs by version
    )
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def world_dir(world: WorldConfig) -> Path:
    return cache_root(world) / f"{world.name}-{config_hash(world)}"


def _paths(root: Path, report: dict | None = None) -> WorldPaths:
    return WorldPaths(
        root, root / "tokenizer", root / "target", root / "draft", root / "splits", report or {}
    )


# ---------------------------------------------------------------- text and splits


def _key_hash(key: str) -> int:
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)


def split_of(module_key: str) -> str:
    """Deterministic split of a module by the hash of its path relative to the stdlib folder."""
    u = (_key_hash(module_key) % 10_000) / 10_000
    edge = 0.0
    for name, frac in zip(SPLITS, SPLIT_FRACTIONS, strict=True):
        edge += frac
        if u < edge:
            return name
    return SPLITS[-1]


def stdlib_files(max_files: int | None = None) -> list[tuple[str, Path]]:
    """(module key, path) of the stdlib's .py files, skipping tests, site-packages and generated tables.

    With max_files, the files come first in hash order (a random but fixed sample, so the splits keep their
    proportions); otherwise sorted by key."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-"))
        for fn in sorted(filenames):
            if not fn.endswith(".py") or fn.startswith("_sysconfigdata"):
                continue
            path = Path(dirpath) / fn
            if path.stat().st_size > MAX_FILE_BYTES:
                continue
            found.append((path.relative_to(root).as_posix(), path))
    if max_files is not None:
        found = sorted(found, key=lambda kp: _key_hash(kp[0]))[:max_files]
    return sorted(found)


def stdlib_split_files(world: WorldConfig) -> dict[str, list[tuple[str, Path]]]:
    """split -> [(module key, path)], disjoint by construction (each key has one split)."""
    out: dict[str, list[tuple[str, Path]]] = {s: [] for s in SPLITS}
    for key, path in stdlib_files(world.max_files):
        out[split_of(key)].append((key, path))
    return out


def stdlib_splits(world: WorldConfig | None = None) -> dict[str, list[str]]:
    """split ("train" / "validation" / "test") -> texts of its stdlib modules (deterministic, disjoint)."""
    world = world if world is not None else WorldConfig()
    return {
        s: [p.read_text(encoding="utf-8", errors="replace") for _, p in files]
        for s, files in stdlib_split_files(world).items()
    }


def _token_stream(tokenizer, texts: list[str]) -> np.ndarray:
    """bos + text + eos for every file, concatenated. -> [N] int32."""
    enc = tokenizer(texts, add_special_tokens=True)["input_ids"]
    eos = tokenizer.eos_token_id
    return np.fromiter((t for ids in enc for t in [*ids, eos]), dtype=np.int32)


# ---------------------------------------------------------------- build


@contextmanager
def file_lock(path: Path):
    """Inter-process lock so parallel test sessions / scripts build a world once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def load_world(world: WorldConfig) -> WorldPaths | None:
    """The cached world for this config, or None if it has not been built."""
    root = world_dir(world)
    report = root / "report.json"
    if not report.exists():
        return None
    return _paths(root, json.loads(report.read_text()))


def ensure_world(world: WorldConfig, progress: bool = True) -> WorldPaths:
    """Build the world once (tokenizer, target, draft, splits, report) or return the cached one."""
    found = load_world(world)
    if found is not None:  # silent: every model load resolves world paths through here
        return found
    root = world_dir(world)
    with file_lock(root.parent / f"{root.name}.lock"):
        found = load_world(world)  # another process may have finished while we waited
        if found is not None:
            return found
        for stale in root.parent.glob(f"{root.name}.tmp-*"):  # left by killed builds (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = root.parent / f"{root.name}.tmp-{os.getpid()}"
        threads = torch.get_num_threads()
        if world.num_threads:
            torch.set_num_threads(world.num_threads)
        try:
            report = _build(world, _paths(tmp), progress)
        finally:
            torch.set_num_threads(threads)
        report["folder"] = str(root)
        (tmp / "report.json").write_text(json.dumps(report, indent=2))
        shutil.rmtree(root, ignore_errors=True)
        tmp.rename(root)
    return _paths(root, report)  # the callers that show the report print format_report(paths.report)


@dataclass
class BuildEstimate:
    """Seconds per training step of each phase, from timed steps of throwaway models (the first steps of a run are
    slower than its steady state, so this over-estimates; `after_draft` corrects it with the draft's real pace)."""

    world: WorldConfig
    draft_s: float
    target_s: float

    def seconds(self, scale: float = 1.0, draft: bool = True) -> float:
        w = self.world
        grown = w.target_grow_train.max_steps * self.target_s * w.grow_factor if w.grow_factor > 1 else 0.0
        steps = w.target_train.max_steps * self.target_s + grown
        if draft:
            steps += w.draft_train.max_steps * self.draft_s
        # + evaluation, samples and saving: about half a minute for the tiny world
        return scale * steps + 30.0

    def describe(self) -> str:
        return (
            f"estimated build time ~{self.seconds() / 60:.1f} min (timed probe steps: draft {self.draft_s:.2f} s, "
            f"target {self.target_s:.2f} s, x{self.world.draft_train.max_steps} and "
            f"x{self.world.target_train.max_steps} + {self.world.target_grow_train.max_steps} grown; the first steps "
            "run slower than the rest, so this is an upper bound unless the machine gets busier)"
        )

    def after_draft(self, draft_seconds: float) -> str:
        scale = draft_seconds / max(self.world.draft_train.max_steps * self.draft_s, 1e-9)
        return f"target: ~{self.seconds(scale, draft=False) / 60:.1f} min left (the probe, scaled by the draft's pace)"


def estimate_build(world: WorldConfig, vocab: int, tokenizer) -> BuildEstimate:
    """Time a few training steps of throwaway models of each size (seconds; the global RNG is reseeded before every
    real model, so the probe does not change the world)."""
    times = {}
    for role, size, tcfg in (
        ("draft", world.draft, world.draft_train),
        ("target", world.target, world.target_train),
    ):
        model = make_llama(size, vocab, world.max_position_embeddings, tokenizer)
        times[role] = step_seconds(model, tcfg, vocab)
    return BuildEstimate(world, times["draft"], times["target"])


def _tokenize(world: WorldConfig, paths: WorldPaths, log) -> tuple:
    """Train the BPE tokenizer on the train split and save it and every split's token stream.
    -> (files per split, texts per split, tokenizer, token streams per split, seconds)."""
    for d in (paths.tokenizer_dir, paths.target_dir, paths.draft_dir, paths.splits_dir):
        d.mkdir(parents=True, exist_ok=True)
    files = stdlib_split_files(world)
    texts = {s: [p.read_text(encoding="utf-8", errors="replace") for _, p in fs] for s, fs in files.items()}
    for s in SPLITS:
        if not texts[s]:
            raise RuntimeError(
                f"world {world.name}: split {s!r} got no stdlib files (max_files={world.max_files})"
            )
    log(
        f"[world {world.name}] {', '.join(f'{s}: {len(v)} files' for s, v in texts.items())}; training tokenizer"
    )

    t0 = time.perf_counter()
    tokenizer = train_bpe_tokenizer(texts["train"], world.vocab_size)
    tokenizer.save_pretrained(paths.tokenizer_dir)
    streams = {s: _token_stream(tokenizer, texts[s]) for s in SPLITS}
    for s, ids in streams.items():
        np.save(paths.splits_dir / f"{s}.npy", ids)
    (paths.splits_dir / "files.json").write_text(
        json.dumps({s: [k for k, _ in fs] for s, fs in files.items()})
    )
    tok_seconds = time.perf_counter() - t0
    log(
        f"[world {world.name}] tokenizer: {len(tokenizer)} tokens ({tok_seconds:.1f}s); "
        + ", ".join(f"{s}: {len(v):,} tokens" for s, v in streams.items())
    )
    return files, texts, tokenizer, streams, tok_seconds


def _train_role(
    world: WorldConfig, role: str, tokenizer, streams: dict, windows, progress: bool, log
) -> tuple:
    """(model, stats) of one role ("draft" | "target") trained on the train stream; a target with grow_factor > 1
    is trained, grown in depth (grow_depth) and trained again."""
    size, tcfg, seed_off = (
        (world.draft, world.draft_train, 1) if role == "draft" else (world.target, world.target_train, 0)
    )
    vocab = len(tokenizer)
    torch.manual_seed(world.seed + seed_off)
    model = make_llama(size, vocab, world.max_position_embeddings, tokenizer)
    desc = f"{world.name} {role}"
    stats = train_lm(model, streams["train"], tcfg, world.seed + seed_off, desc=desc, progress=progress)
    if role == "target" and world.grow_factor > 1:
        stats["before_grow"] = {
            "num_layers": size.num_layers,
            "heldout_loss": round(heldout_loss(model, windows), 4),
        }
        model = grow_depth(model, world.grow_factor)
        grow = train_lm(
            model,
            streams["train"],
            world.target_grow_train,
            world.seed + 7,
            desc=f"{desc} x{world.grow_factor} layers",
            progress=progress,
        )
        stats["grow"] = grow
        stats["steps"] += grow["steps"]
        stats["train_seconds"] = round(stats["train_seconds"] + grow["train_seconds"], 1)
        stats["train_tokens"] += grow["train_tokens"]
    loss = heldout_loss(model, windows)
    stats.update(
        params=num_params(model),
        size=asdict(size),
        num_layers=model.config.num_hidden_layers,
        heldout_loss=round(loss, 4),
        heldout_ppl=round(float(np.exp(loss)), 2),
        forward_ms=round(forward_ms(model, vocab), 3),
    )
    log(
        f"[world {world.name}] {role}: {stats['params'] / 1e6:.2f}M params, {stats['steps']} steps in "
        f"{stats['train_seconds']}s, held-out loss {loss:.3f}, {stats['forward_ms']:.2f} ms/token"
    )
    return model, stats


def _save_model(model, tokenizer, out_dir: Path) -> None:
    """The checkpoint with the tokenizer's special ids in its generation config and the tokenizer beside it (each
    checkpoint loads on its own by path)."""
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _build(world: WorldConfig, paths: WorldPaths, progress: bool) -> dict:
    t_start = time.perf_counter()
    log = print if progress else (lambda *a, **k: None)
    files, texts, tokenizer, streams, tok_seconds = _tokenize(world, paths, log)
    vocab = len(tokenizer)
    windows = eval_windows(streams["validation"], world.target_train.seq_len, max_windows=64)  # [W, T]
    test_starts = np.flatnonzero(streams["test"] == tokenizer.bos_token_id)[:NUM_SAMPLES]
    sample_prompts = [streams["test"][s : s + 24].tolist() for s in test_starts]

    estimate = None
    if progress:  # a time estimate for the whole build before it starts (each model's bar then shows its own)
        estimate = estimate_build(world, vocab, tokenizer)
        log(f"[world {world.name}] {estimate.describe()}")
    models = {}
    for role in ("draft", "target"):  # the draft first: it is short, the target gets the rest
        model, stats = _train_role(world, role, tokenizer, streams, windows, progress, log)
        _save_model(model, tokenizer, paths.target_dir if role == "target" else paths.draft_dir)
        models[role] = (model, stats)
        if role == "draft" and estimate is not None:
            log(f"[world {world.name}] {estimate.after_draft(stats['train_seconds'])}")

    uni = unigram_loss(streams["train"], windows, vocab)
    target_model, target_stats = models["target"]
    samples = generate_samples(target_model, tokenizer, sample_prompts, max_new_tokens=48, seed=world.seed)
    for s in samples:
        log(f"--- sample (target)\n{s['prompt']}\u2502{s['continuation']}")
    times = (vocab, tok_seconds, t_start)
    return _report(world, texts, streams, windows, target_stats, models["draft"][1], uni, samples, times)


def _report(
    world: WorldConfig, texts, streams, windows, target_stats, draft_stats, uni, samples, times
) -> dict:
    """The world's report.json: sizes, the models' stats, the unigram baseline, samples and timings."""
    vocab, tok_seconds, t_start = times
    return {
        "name": world.name,
        "config_hash": config_hash(world),
        "config": asdict(world),
        "python": sys.version.split()[0],
        "torch_threads": torch.get_num_threads(),
        "load_avg_1m_at_end": round(os.getloadavg()[0], 2),  # other processes' load: it skews the ms numbers
        "files": {s: len(v) for s, v in texts.items()},
        "tokens": {s: int(len(v)) for s, v in streams.items()},
        "vocab_size": vocab,
        "tokenizer_seconds": round(tok_seconds, 1),
        "eval_tokens": int(windows[:, 1:].numel()),
        "target": target_stats,
        "draft": draft_stats,
        "unigram": {"heldout_loss": round(uni, 4), "heldout_ppl": round(float(np.exp(uni)), 2)},
        # flat keys for quick use: held-out loss / ppl and ms per token
        "target_loss": target_stats["heldout_loss"],
        "draft_loss": draft_stats["heldout_loss"],
        "unigram_loss": round(uni, 4),
        "target_ppl": target_stats["heldout_ppl"],
        "draft_ppl": draft_stats["heldout_ppl"],
        "unigram_ppl": round(float(np.exp(uni)), 2),
        "target_ms": target_stats["forward_ms"],
        "draft_ms": draft_stats["forward_ms"],
        "draft_target_cost_ratio": round(draft_stats["forward_ms"] / target_stats["forward_ms"], 4),
        "samples": samples,
        "build_seconds": round(time.perf_counter() - t_start, 1),
    }


def retrain_draft(world: WorldConfig, progress: bool = True) -> dict:
    """Train the built world's draft again (same config and seed) and update its checkpoint and report.

    For a build whose draft was starved by a loaded machine (its minute cap hit after few steps); the target and
    the tokenizer are untouched, so regenerated data stays valid."""
    from transformers import AutoTokenizer

    paths = load_world(world)
    if paths is None:
        raise RuntimeError(f"world {world.name} is not built yet (python train/pretrain.py)")
    with file_lock(paths.root.parent / f"{paths.root.name}.lock"):
        report = paths.report
        tokenizer = AutoTokenizer.from_pretrained(paths.tokenizer_dir)
        train_ids = np.load(paths.splits_dir / "train.npy")
        windows = eval_windows(np.load(paths.splits_dir / "validation.npy"), world.target_train.seq_len, 64)
        torch.manual_seed(world.seed + 1)
        model = make_llama(world.draft, report["vocab_size"], world.max_position_embeddings, tokenizer)
        stats = train_lm(model, train_ids, world.draft_train, world.seed + 1, f"{world.name} draft", progress)
        loss = heldout_loss(model, windows)
        stats.update(
            params=num_params(model),
            size=asdict(world.draft),
            num_layers=world.draft.num_layers,
            heldout_loss=round(loss, 4),
            heldout_ppl=round(float(np.exp(loss)), 2),
            forward_ms=round(forward_ms(model, report["vocab_size"]), 3),
        )
        for key in ("pad_token_id", "eos_token_id", "bos_token_id"):
            setattr(model.generation_config, key, getattr(tokenizer, key))
        model.save_pretrained(paths.draft_dir)
        tokenizer.save_pretrained(paths.draft_dir)
        report.setdefault("draft_first_build", report["draft"])
        report["draft"] = stats
        report.update(
            draft_loss=stats["heldout_loss"], draft_ppl=stats["heldout_ppl"], draft_ms=stats["forward_ms"]
        )
        report["draft_target_cost_ratio"] = round(report["draft_ms"] / report["target_ms"], 4)
        (paths.root / "report.json").write_text(json.dumps(report, indent=2))
    if progress:
        print(format_report(report))
    return report


def remeasure_speed(world: WorldConfig, reps: int = 60) -> dict:
    """Measure the built world's per-token forward times again (e.g. on an idle machine) and update report.json.

    Build-time numbers are taken while the machine may be busy; the previous values are kept as *_at_build."""
    from transformers import AutoModelForCausalLM

    paths = load_world(world)
    if paths is None:
        raise RuntimeError(f"world {world.name} is not built yet (python train/pretrain.py)")
    report = paths.report
    for role, folder in (("target", paths.target_dir), ("draft", paths.draft_dir)):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        ms = round(forward_ms(model, report["vocab_size"], reps=reps), 3)
        report[role].setdefault("forward_ms_at_build", report[role]["forward_ms"])
        report[role]["forward_ms"] = ms
        report[f"{role}_ms"] = ms
    report["draft_target_cost_ratio"] = round(report["draft_ms"] / report["target_ms"], 4)
    report["speed_threads"] = torch.get_num_threads()
    report["speed_load_avg_1m"] = round(os.getloadavg()[0], 2)
    (paths.root / "report.json").write_text(json.dumps(report, indent=2))
    return report


def format_report(report: dict) -> str:
    """The world report as a small text table."""
    rows = [("model", "params", "steps", "train s", "held-out loss", "ppl", "ms/token")]
    for role in ("target", "draft"):
        r = report[role]
        rows.append(
            (
                role,
                f"{r['params'] / 1e6:.2f}M",
                str(r["steps"]),
                f"{r['train_seconds']:.0f}",
                f"{r['heldout_loss']:.3f}",
                f"{r['heldout_ppl']:.1f}",
                f"{r['forward_ms']:.2f}",
            )
        )
        if role == "target" and "before_grow" in r:
            b = r["before_grow"]
            rows.append(
                (
                    f"  at {b['num_layers']} layers",
                    "",
                    "",
                    "",
                    f"{b['heldout_loss']:.3f}",
                    f"{np.exp(b['heldout_loss']):.1f}",
                    "",
                )
            )
    u = report["unigram"]
    rows.append(("unigram", "-", "-", "-", f"{u['heldout_loss']:.3f}", f"{u['heldout_ppl']:.1f}", "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        f"world {report['name']} ({report.get('folder', '')}), vocab {report['vocab_size']}, "
        f"built in {report['build_seconds']:.0f}s, draft/target cost c = {report['draft_target_cost_ratio']:.3f}"
    ]
    for i, r in enumerate(rows):
        lines.append("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)

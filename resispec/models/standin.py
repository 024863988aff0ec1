"""`standin=true`: a local stand-in for a real recipe's hub pair and hub dataset, built here from shipped files.

The stand-in keeps what the code path depends on and shrinks what it does not:

- models: the real `config.json` (resispec/models/hub_configs/<org>/<name>/) with its architecture class, vocabulary
  size, special-token ids, eos list, rope settings, tied/untied embeddings, head_dim and GQA ratio; only width,
  depth and the MLP shrink (STANDIN_SIZES), with random weights (embeddings scaled up so greedy text varies);
- tokenizer: the real vocabulary size with the real special tokens at their real ids, ordinary tokens from a
  byte-level BPE trained here on stdlib text (padded with unreachable filler tokens up to the first special id),
  and a chat template rendering the real format (templates/llama3.jinja, templates/qwen3.jinja);
- data: a local dataset folder shaped like HuggingFaceH4/ultrachat_200k (splits train_sft / test_sft / train_gen
  / test_gen, columns prompt, prompt_id, messages), loaded by the same `datasets.load_dataset(source, split=...)`.

Built once under `<cache>/standin-<family>-<hash>/` (the tiny world's cache root), keyed by a hash of everything
that changes the result; `report.json` marks a finished build (built in a temporary folder, renamed into place
under a lock, so a killed build leaves nothing half-written).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from resispec.errors import UserError
from resispec.models.factory import train_bpe_tokenizer
from resispec.models.hub_configs import HUB_CONFIGS, shipped_config_dir, shipped_hub_names
from resispec.models.loading import resolve_device
from resispec.models.world import cache_root, file_lock, stdlib_files

STANDIN_FORMAT = 5  # bump when the build changes in a way that invalidates cached stand-ins
SPLITS = ("train_sft", "test_sft", "train_gen", "test_gen")
# test_sft is both the eval split and the bench's test split of the ultrachat recipes: the bench's prompts start
# after the rows the eval prompt set draws from (data.num_eval_prompts + a margin), so it needs more than that
ROWS_PER_SPLIT = {"train_sft": 512, "test_sft": 1024, "train_gen": 64, "test_gen": 64}
# hub datasets the stand-in can replace (source name -> the split names it has)
DATASETS = {"HuggingFaceH4/ultrachat_200k": SPLITS}
BPE_VOCAB = 4096  # ordinary tokens learned here; the rest of the id range below the specials is filler
BPE_TEXT_FILES = 160  # stdlib modules the BPE and the dataset are drawn from (a fixed sample)
EMBED_SCALE = 8.0  # random micro models with default init repeat one token under greedy decoding (NOTES.md)


class StandinError(UserError, ValueError):
    """standin=true cannot be honoured: no shipped config.json, a dataset or split the stand-in lacks."""


@dataclass(frozen=True)
class StandinSize:
    """The shrunk shape of one stand-in model: the GQA ratio and head_dim stay the real model's."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int


# the target keeps 2 layers, the draft 1; both stay small enough that a distill step takes about a second here
TARGET_SIZE = StandinSize(hidden_size=128, num_layers=2, num_heads=4, intermediate_size=256)
DRAFT_SIZE = StandinSize(hidden_size=64, num_layers=1, num_heads=4, intermediate_size=128)


@dataclass(frozen=True)
class Family:
    """What a model family's tokenizer looks like: special tokens at their ids, the bos/eos/pad roles, BOS on
    encode, the chat template, and the tokenizer's length (Qwen3's is below its model's padded vocabulary)."""

    name: str
    specials: tuple[tuple[int, str, bool], ...]  # (id, content, special) in id order
    bos: str | None
    eos: str
    pad: str | None
    add_bos: bool
    model_max_length: int

    @property
    def first_special(self) -> int:
        return self.specials[0][0]

    @property
    def tokenizer_len(self) -> int:
        return self.specials[-1][0] + 1

    @property
    def template(self) -> str:
        return (HUB_CONFIGS / "templates" / f"{self.name}.jinja").read_text()


def _llama3_specials() -> tuple[tuple[int, str, bool], ...]:
    named = {
        128000: "<|begin_of_text|>",
        128001: "<|end_of_text|>",
        128002: "<|reserved_special_token_0|>",
        128003: "<|reserved_special_token_1|>",
        128004: "<|finetune_right_pad_id|>",
        128005: "<|reserved_special_token_2|>",
        128006: "<|start_header_id|>",
        128007: "<|end_header_id|>",
        128008: "<|eom_id|>",
        128009: "<|eot_id|>",
        128010: "<|python_tag|>",
    }
    out = [(i, named[i], True) for i in sorted(named)]
    out += [(128011 + k, f"<|reserved_special_token_{3 + k}|>", True) for k in range(128256 - 128011)]
    return tuple(out)


def _qwen3_specials() -> tuple[tuple[int, str, bool], ...]:
    special = [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|object_ref_start|>",
        "<|object_ref_end|>",
        "<|box_start|>",
        "<|box_end|>",
        "<|quad_start|>",
        "<|quad_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|vision_pad|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ]
    # added but not special (decoded even with skip_special_tokens): tool calls, fill-in-the-middle, thinking
    plain = [
        "<tool_call>",
        "</tool_call>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
    ]
    tokens = [(t, True) for t in special] + [(t, False) for t in plain]
    return tuple((151643 + i, t, s) for i, (t, s) in enumerate(tokens))


FAMILIES = {
    "llama3": Family(
        "llama3",
        _llama3_specials(),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",  # the Instruct tokenizers' eos; generation_config.json lists all three
        pad=None,
        add_bos=True,
        model_max_length=131072,
    ),
    "qwen3": Family(
        "qwen3",
        _qwen3_specials(),
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        add_bos=False,
        model_max_length=131072,
    ),
}


def family_of(config: dict) -> Family:
    """The tokenizer family of a real config.json (by model_type and vocabulary size)."""
    kind = config.get("model_type")
    if kind == "llama" and config.get("vocab_size") == 128256:
        return FAMILIES["llama3"]
    if kind == "qwen3":
        return FAMILIES["qwen3"]
    raise StandinError(
        f"no stand-in tokenizer for model_type {kind!r} with vocab_size {config.get('vocab_size')} "
        f"(the stand-in knows Llama 3 and Qwen3: {', '.join(FAMILIES)})"
    )


# ---------------------------------------------------------------- the spec and its cache folder


@dataclass(frozen=True)
class StandinSpec:
    """What a stand-in is built from: the two hub names (their shipped files) and the dataset it mimics."""

    target: str
    draft: str
    dataset: str

    def files(self) -> dict:
        out = {}
        for role, name in (("target", self.target), ("draft", self.draft)):
            folder = shipped_config_dir(name)
            assert folder is not None, name
            out[role] = {
                f.name: json.loads(f.read_text())
                for f in (folder / "config.json", folder / "generation_config.json")
                if f.exists()
            }
        return out

    def family(self) -> Family:
        return family_of(self.files()["target"]["config.json"])

    def hash(self) -> str:
        family = self.family()
        spec = {
            "format": STANDIN_FORMAT,
            "names": [self.target, self.draft, self.dataset],
            "files": self.files(),
            "template": family.template,
            "sizes": [TARGET_SIZE.__dict__, DRAFT_SIZE.__dict__],
            "bpe": [BPE_VOCAB, BPE_TEXT_FILES],
            "rows": ROWS_PER_SPLIT,
            "embed_scale": EMBED_SCALE,
            "python": f"{sys.version_info.major}.{sys.version_info.minor}",  # the stdlib text differs by version
        }
        return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class StandinPaths:
    root: Path
    target_dir: Path
    draft_dir: Path
    data_dir: Path
    report: dict


def _paths(root: Path, digest: str, report: dict | None = None) -> StandinPaths:
    # the dataset folder's name carries the hash: `datasets` caches a local folder's arrow files by the folder's
    # name and its file names, not their contents, so a rebuilt stand-in under a fixed name would load stale rows
    data = root / f"ultrachat_200k-{digest}"
    return StandinPaths(root, root / "target", root / "draft", data, report or {})


def standin_dir(spec: StandinSpec, cache: Path) -> Path:
    return cache / f"standin-{spec.family().name}-{spec.hash()}"


def load_standin(spec: StandinSpec, cache: Path) -> StandinPaths | None:
    """The cached stand-in of this spec, or None if it has not been built."""
    root = standin_dir(spec, cache)
    report = root / "report.json"
    return _paths(root, spec.hash(), json.loads(report.read_text())) if report.exists() else None


def ensure_standin(spec: StandinSpec, cache: Path, progress: bool = True) -> StandinPaths:
    """Build the stand-in once (tokenizer, target, draft, dataset, report) or return the cached one."""
    found = load_standin(spec, cache)
    if found is not None:
        return found
    root = standin_dir(spec, cache)
    with file_lock(root.parent / f"{root.name}.lock"):
        found = load_standin(spec, cache)  # another process may have finished while we waited
        if found is not None:
            return found
        for stale in root.parent.glob(f"{root.name}.tmp-*"):  # left by killed builds (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = root.parent / f"{root.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            report = _build(spec, _paths(tmp, spec.hash()), progress)
            report["folder"] = str(root)
            (tmp / "report.json").write_text(json.dumps(report, indent=2))
            shutil.rmtree(root, ignore_errors=True)
            tmp.rename(root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return _paths(root, spec.hash(), report)


# ---------------------------------------------------------------- text


def _sample_modules() -> list[tuple[str, str]]:
    """(module key, source) of a fixed sample of stdlib modules (the tiny world's file walk, in hash order)."""
    out = []
    for key, path in stdlib_files(BPE_TEXT_FILES):
        out.append((key, path.read_text(encoding="utf-8", errors="replace")))
    return out


def _qa_pairs(key: str, source: str) -> list[tuple[str, str, str, str, str]]:
    """(module, name, kind, answer, first source line) per documented function or class of a module: the docstring answers."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    module = key.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
    lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 40:
            continue
        kind = "class" if isinstance(node, ast.ClassDef) else "function"
        signature = lines[node.lineno - 1].strip() if node.lineno <= len(lines) else ""
        out.append((module, node.name, kind, doc.strip()[:1200], signature))
    return out


QUESTIONS = (
    "What does the {kind} `{name}` in the Python module `{module}` do?",
    "I am reading the Python module `{module}`. Can you explain what its {kind} `{name}` is for?",
)


def _dataset_rows() -> dict[str, list[dict]]:
    """Rows shaped like ultrachat_200k, per split, from stdlib docstrings: a user question about a documented
    function or class, its docstring as the answer, and for every third object a follow-up turn (so `messages` has
    multi-turn conversations too). Each object gives one row per phrasing in QUESTIONS, all in one split, so the
    splits share no object."""
    objects = []
    for key, source in _sample_modules():
        objects.extend(_qa_pairs(key, source))
    objects = list({o[:3]: o for o in objects}.values())  # methods of one name in one module: once
    objects.sort(key=lambda o: hashlib.sha256("/".join(o[:3]).encode()).hexdigest())  # a fixed shuffle
    rows: dict[str, list[dict]] = {s: [] for s in SPLITS}
    it = iter(objects)
    for split in SPLITS:
        for module, name, kind, answer, signature in it:
            follow_up = signature and hashlib.sha256(f"{module}.{name}".encode()).digest()[0] % 3 == 0
            for template in QUESTIONS:
                question = template.format(kind=kind, name=name, module=module)
                messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
                if follow_up:
                    messages += [
                        {"role": "user", "content": "How is it defined? Show me the first line."},
                        {"role": "assistant", "content": f"It starts with:\n\n```python\n{signature}\n```"},
                    ]
                prompt_id = hashlib.sha256(question.encode()).hexdigest()
                rows[split].append({"prompt": question, "prompt_id": prompt_id, "messages": messages})
            if len(rows[split]) >= ROWS_PER_SPLIT[split]:
                break
    short = [s for s in SPLITS if len(rows[s]) < ROWS_PER_SPLIT[s]]
    if short:
        raise RuntimeError(f"stand-in dataset: too few documented stdlib objects for splits {short}")
    return rows


DATASET_CARD = """---
configs:
- config_name: default
  data_files:
{files}
---
# Stand-in for HuggingFaceH4/ultrachat_200k

Built locally by resispec (resispec/models/standin.py) from Python stdlib docstrings: the same split names and
columns (`prompt`, `prompt_id`, `messages`) as the hub dataset, {rows} rows.
"""


def _write_dataset(root: Path) -> dict[str, int]:
    import datasets

    rows = _dataset_rows()
    (root / "data").mkdir(parents=True, exist_ok=True)
    files = []
    for split, split_rows in rows.items():
        name = f"data/{split}-00000-of-00001.parquet"
        datasets.Dataset.from_list(split_rows).to_parquet(str(root / name))
        files.append(f"  - split: {split}\n    path: {name}")
    counts = {s: len(r) for s, r in rows.items()}
    card = DATASET_CARD.format(files="\n".join(files), rows=", ".join(f"{s} {n}" for s, n in counts.items()))
    (root / "README.md").write_text(card)
    return counts


# ---------------------------------------------------------------- tokenizer


def build_tokenizer(family: Family, texts: list[str]):
    """A PreTrainedTokenizerFast with the family's special tokens at their real ids and the real vocabulary range:
    a byte-level BPE trained on `texts` (ids 0..BPE_VOCAB-1), unreachable filler tokens up to the first special id,
    then the specials; BOS on encode where the real one adds it; the family's chat template."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    trained = train_bpe_tokenizer(texts, BPE_VOCAB)  # its 3 own specials sit at ids 0-2
    state = json.loads(trained.backend_tokenizer.to_str())
    own = {t["content"] for t in state["added_tokens"]}
    ordinary = [t for t, _ in sorted(state["model"]["vocab"].items(), key=lambda kv: kv[1]) if t not in own]
    vocab = {t: i for i, t in enumerate(ordinary)}
    for i in range(len(vocab), family.first_special):  # never produced by a merge: BPE cannot reach them
        vocab[f"<|standin_filler_{i}|>"] = i
    state["model"]["vocab"] = vocab
    state["added_tokens"] = [
        {
            "id": i,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": special,
        }
        for i, content, special in family.specials
    ]
    state["post_processor"] = None
    tok = Tokenizer.from_str(json.dumps(state))
    if family.add_bos:
        bos_id = tok.token_to_id(family.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{family.bos} $A",
            pair=f"{family.bos} $A {family.bos} $B",
            special_tokens=[(family.bos, bos_id)],
        )
    extra = [
        c for _, c, special in family.specials if special and c not in (family.bos, family.eos, family.pad)
    ]
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=family.bos,
        eos_token=family.eos,
        pad_token=family.pad,
        additional_special_tokens=extra,
        model_max_length=family.model_max_length,
        chat_template=family.template,
        clean_up_tokenization_spaces=False,
    )


# ---------------------------------------------------------------- models


def shrunk_config(real: dict, size: StandinSize):
    """The real config (a transformers config object) with width, depth and MLP shrunk; head_dim, the GQA ratio,
    vocabulary, special ids, rope and tying kept."""
    from transformers import AutoConfig

    heads, kv = real["num_attention_heads"], real.get("num_key_value_heads", real["num_attention_heads"])
    ratio = heads // kv
    num_heads = max(ratio, size.num_heads - size.num_heads % ratio)
    head_dim = real.get("head_dim") or real["hidden_size"] // heads
    values = {
        k: v for k, v in real.items() if k not in ("architectures", "transformers_version", "torch_dtype")
    }
    values.update(
        hidden_size=size.hidden_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads // ratio,
        head_dim=head_dim,
        intermediate_size=size.intermediate_size,
    )
    if "max_window_layers" in values:
        values["max_window_layers"] = size.num_layers
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    config.architectures = list(real["architectures"])
    return config


def build_model(files: dict, size: StandinSize, seed: int):
    """A random-weight model of the real architecture at `size`, bf16 like the real checkpoint, with the real
    generation_config.json (eos list, sampling defaults)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = shrunk_config(files["config.json"], size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # varied greedy text (NOTES.md): scale the embeddings, and the head when untied
        model.get_input_embeddings().weight.mul_(EMBED_SCALE)
        if not config.tie_word_embeddings:
            model.get_output_embeddings().weight.mul_(EMBED_SCALE)
    if "generation_config.json" in files:
        model.generation_config = GenerationConfig.from_dict(files["generation_config.json"])
    return model.to(torch.bfloat16).eval()


def _build(spec: StandinSpec, paths: StandinPaths, progress: bool) -> dict:
    log = print if progress else (lambda *a, **k: None)
    t0 = time.perf_counter()
    files = spec.files()
    family = spec.family()
    log(f"[standin] building the {family.name} stand-in of {spec.target} + {spec.draft} and {spec.dataset}")
    modules = _sample_modules()
    tokenizer = build_tokenizer(family, [text for _, text in modules])
    t_tok = time.perf_counter() - t0
    report = {"family": family.name, "target": spec.target, "draft": spec.draft, "dataset": spec.dataset}
    for role, folder, size, seed in (
        ("target", paths.target_dir, TARGET_SIZE, 0),
        ("draft", paths.draft_dir, DRAFT_SIZE, 1),
    ):
        model = build_model(files[role], size, seed)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)  # target and draft carry the same tokenizer files
        report[f"{role}_params"] = sum(p.numel() for p in model.parameters())
        report[f"{role}_config"] = {
            k: getattr(model.config, k)
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
            )
        }
    counts = _write_dataset(paths.data_dir)
    report.update(
        vocab_size=files["target"]["config.json"]["vocab_size"],
        tokenizer_len=len(tokenizer),
        bpe_tokens=BPE_VOCAB,
        rows=counts,
        tokenizer_seconds=round(t_tok, 1),
        build_seconds=round(time.perf_counter() - t0, 1),
        config_hash=spec.hash(),
    )
    log(
        f"[standin] built in {report['build_seconds']:.0f} s: target {report['target_params'] / 1e6:.1f}M, "
        f"draft {report['draft_params'] / 1e6:.1f}M params, vocab {report['vocab_size']:,}, rows {counts}"
    )
    return report


# ---------------------------------------------------------------- the override


def _hub_name(role: str, path: str) -> str:
    """The hub name a model path stands for, or a StandinError saying why it has no stand-in."""
    folder = shipped_config_dir(path) if not Path(path).expanduser().exists() else None
    if folder is None:
        raise StandinError(
            f"standin=true: {role}.path={path!r} has no shipped config.json to build a stand-in from (shipped: "
            f"{', '.join(shipped_hub_names())}; add resispec/models/hub_configs/<org>/<name>/config.json for "
            "another hub model, or drop standin=true)"
        )
    return path


def standin_spec(cfg) -> StandinSpec:
    """The stand-in a config asks for (checked before anything is built)."""
    target = _hub_name("target", cfg.target.path)
    draft = _hub_name("draft", cfg.draft.path)
    data = cfg.data
    if data.source not in DATASETS:
        raise StandinError(
            f"standin=true: data.source={data.source!r} has no stand-in (stand-ins exist for "
            f"{', '.join(DATASETS)}); drop standin=true or use one of those"
        )
    splits = DATASETS[data.source]
    for key in ("split", "eval_split", "test_split"):
        name = getattr(data, key, None)
        if name is not None and name not in splits:
            raise StandinError(
                f"standin=true: data.{key}={name!r} is not a split of {data.source} (its splits: "
                f"{', '.join(splits)}); set data.{key} to one of them"
            )
    family_t = family_of(json.loads((shipped_config_dir(target) / "config.json").read_text()))
    family_d = family_of(json.loads((shipped_config_dir(draft) / "config.json").read_text()))
    if family_t != family_d:
        raise StandinError(
            f"standin=true: target {target} ({family_t.name}) and draft {draft} ({family_d.name}) do not share a "
            "tokenizer family"
        )
    return StandinSpec(target=target, draft=draft, dataset=data.source)


def apply_standin(cfg):
    """The config with target.path / draft.path / data.source pointing at the local stand-in (built once and
    cached); everything else (recipe name, splits, loss, tree, batch) unchanged, except that a 16-bit model that
    runs on the CPU loads in float32."""
    spec = standin_spec(cfg)
    paths = ensure_standin(spec, cache_root(cfg.world))
    return replace(
        cfg,
        target=_on_this_machine(replace(cfg.target, path=str(paths.target_dir))),
        draft=_on_this_machine(replace(cfg.draft, path=str(paths.draft_dir))),
        data=replace(cfg.data, source=str(paths.data_dir)),
    )


def _on_this_machine(model):
    """A 16-bit model that will run on the CPU is loaded in float32: CPUs without native bf16 run the stand-in's
    128k-vocabulary head about 3x slower in bf16 (measured here: 342 vs 114 ms per token under load). Training's
    mixed precision (train.mixed_precision) is left as the recipe sets it."""
    if model.dtype in ("bfloat16", "float16") and resolve_device(model.device).type == "cpu":
        return replace(model, dtype="float32")
    return model


def standin_report(model_path: str) -> dict | None:
    """The build report of the stand-in a model folder belongs to (target/ or draft/ of a stand-in), else None."""
    root = Path(model_path).expanduser().parent
    report = root / "report.json"
    if not root.name.startswith("standin-") or not report.is_file():
        return None
    return json.loads(report.read_text())


def format_standin(report: dict) -> str:
    """The stand-in's report as a few lines: what it stands in for, its shapes and where it lives."""
    lines = [
        f"stand-in ({report['family']}) of {report['target']} + {report['draft']} and {report['dataset']}: "
        f"{report['folder']}, built in {report['build_seconds']:.0f} s",
        f"  vocabulary {report['vocab_size']:,} (tokenizer {report['tokenizer_len']:,}: {report['bpe_tokens']:,} "
        "BPE tokens trained here, filler, the real special tokens at their ids)",
    ]
    for role in ("target", "draft"):
        c = report[f"{role}_config"]
        lines.append(
            f"  {role}: {report[f'{role}_params'] / 1e6:.1f}M params, hidden {c['hidden_size']}, "
            f"{c['num_hidden_layers']} layers, {c['num_attention_heads']} heads / {c['num_key_value_heads']} kv, "
            f"head_dim {c['head_dim']}"
        )
    lines.append("  data: " + ", ".join(f"{s} {n} rows" for s, n in report["rows"].items()))
    return "\n".join(lines)

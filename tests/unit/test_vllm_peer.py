"""vLLM as a bench peer: counters, the peer checks (no vLLM needed), and, with the isolated venv (marker `vllm`,
scripts/test_vllm.sh), a bench run with vLLM rows on the micro world's target and a head_dim-32 draft."""

from __future__ import annotations

import pytest
import torch

from resispec.benchmark.config import BenchConfig
from resispec.benchmark.vllm_peer import counters_to_stats, distribution_check, vllm_ks
from resispec.vllm_venv import parse_spec_metrics, server_command, spec_config

METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 20.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0
vllm:num_requests_running{engine="0"} 0.0
"""


def test_parse_and_stats():
    after = parse_spec_metrics(METRICS)
    assert after == {
        "num_drafts": 10.0,
        "num_draft_tokens": 20.0,
        "num_accepted_tokens": 12.0,
        "accepted_per_pos": [8.0, 4.0],
    }
    before = {
        "num_drafts": 2.0,
        "num_draft_tokens": 4.0,
        "num_accepted_tokens": 2.0,
        "accepted_per_pos": [2.0],
    }
    s = counters_to_stats(before, after, num_new_tokens=18)
    assert (s.num_drafts, s.num_accepted_tokens, s.accepted_per_position, s.reached_per_position) == (
        8,
        10,
        [6, 4],
        [8, 6],
    )
    assert s.tau == pytest.approx(18 / 8)
    assert s.per_depth_acceptance == pytest.approx([6 / 8, 4 / 6])
    empty = parse_spec_metrics("")
    assert counters_to_stats(empty, empty, 5).tau == 1.0


def test_spec_config_and_command():
    assert spec_config("/d", 3, "greedy") == {
        "method": "draft_model",
        "model": "/d",
        "num_speculative_tokens": 3,
    }
    assert spec_config("/d", 2, "probabilistic")["draft_sample_method"] == "probabilistic"
    with pytest.raises(ValueError, match="drafting"):
        spec_config("/d", 2, "typical")
    cmd = server_command("/v/bin/python", "/t", 8001, spec_config("/d", 2, "greedy"))
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "127.0.0.1" in cmd


def test_vllm_ks():

    assert vllm_ks(BenchConfig(trees=[[1, 1, 1, 1], [4, 2, 1, 1]])) == [4]
    assert vllm_ks(BenchConfig(trees=[[4, 2]])) == [2]
    assert vllm_ks(BenchConfig(vllm_k=[3, 2, 3])) == [2, 3]


class _Bigram(torch.nn.Module):
    """A fixed next-token distribution per previous token (a stand-in target with known entropies)."""

    def __init__(self, vocab: int = 12, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=g) * 2.0)

    def forward(self, input_ids):
        return type("Out", (), {"logits": self.table[input_ids]})()


def _sample(model, prompts, n, greedy=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    outs = []
    for p in prompts:
        ids = list(p)
        for _ in range(n):
            probs = torch.softmax(model.table[ids[-1]].detach(), -1)
            ids.append(int(probs.argmax()) if greedy else int(torch.multinomial(probs, 1, generator=g)))
        outs.append(ids[len(p) :])
    return outs


def test_distribution_check_flags_off_distribution():
    model = _Bigram()
    prompts = [[i] for i in range(8)]
    ok = distribution_check(model, prompts, _sample(model, prompts, 60), temperature=1.0)
    assert ok["ok"], ok
    bad = distribution_check(model, prompts, _sample(model, prompts, 60, greedy=True), temperature=1.0)
    assert not bad["ok"] and bad["diff"] < 0, bad  # too-likely tokens: NLL far below the entropy
    # top-k: samples from the 3 likeliest tokens are on the top-3 distribution, not on the full one
    top3 = _Bigram()
    with torch.no_grad():
        kth = top3.table.topk(3, dim=-1).values[:, -1:]
        top3.table.masked_fill_(top3.table < kth, -1e4)
    samples = _sample(top3, prompts, 60, seed=3)
    assert distribution_check(model, prompts, samples, temperature=1.0, top_k=3)["ok"]
    assert not distribution_check(model, prompts, samples, temperature=1.0)["ok"]
    # samples drawn at T = 1 checked as if T = 0.3: flagged too
    assert not distribution_check(model, prompts, _sample(model, prompts, 60), temperature=0.3)["ok"]


# ---------------------------------------------------------------- needs vLLM


@pytest.fixture(scope="module")
def vllm_available():
    from resispec.vllm_venv import vllm_version

    version = vllm_version()
    if version is None:
        pytest.skip("no vLLM venv (scripts/setup_vllm.sh)")
    return version


@pytest.mark.vllm
def test_bench_with_vllm_rows(micro_world, vllm_available, tmp_path):
    """T = 0: vLLM AR and vLLM + draft (greedy drafting, k = 2) equal our greedy tokens; tau from vLLM's counters."""
    from transformers import AutoTokenizer

    from resispec.benchmark.speed import run_bench
    from resispec.decoding.config import DecodeConfig
    from resispec.models import SizeConfig, make_llama
    from resispec.models.config import ModelConfig

    world, paths = micro_world
    tok = AutoTokenizer.from_pretrained(paths.target_dir)
    torch.manual_seed(0)  # the micro draft has head_dim 16 (refused by vLLM's CPU kernel): a head_dim-32 one
    draft = make_llama(SizeConfig(64, 1, 2, 2, 64), len(tok), world.max_position_embeddings, tok)
    draft.save_pretrained(tmp_path / "draft")
    tok.save_pretrained(tmp_path / "draft")
    bench = BenchConfig(
        num_prompts=2,
        warmup=1,
        max_new_tokens=12,
        temperatures=[0.0],
        rules=["chain"],
        trees=[[1, 1]],
        hf_assisted=False,
        vllm=True,
        vllm_drafting=["greedy"],
        vllm_args=["--enforce-eager"],  # no torch.compile at start-up (minutes on a loaded 2-core machine)
    )
    prompts = [tok.encode("def f(x):\n    return"), tok.encode("import os\n")]
    rows = run_bench(
        bench,
        DecodeConfig(),
        ModelConfig(path=str(paths.target_dir)),
        ModelConfig(path=str(tmp_path / "draft")),
        world=world,
        output_dir=tmp_path / "out",
        prompts=prompts,
        progress=False,
        show=False,
    )
    vllm_rows = [r for r in rows if r.method.startswith("vllm")]
    assert [r.method for r in vllm_rows] == ["vllm_ar", "vllm_spec"]
    for r in vllm_rows:
        assert r.stats["peer_check"]["ok"], r.stats
        assert r.tokens_per_second > 0
    spec = vllm_rows[1]
    assert spec.tau is not None and 1.0 <= spec.tau <= 3.0 and len(spec.per_depth_acceptance) == 2


def test_regen_engine_is_checked(micro_world, tmp_path):
    from resispec.data.config import RegenConfig
    from resispec.data.regen import _regen_key, regenerate

    assert "engine" not in _regen_key(RegenConfig())  # the built-in engine keeps its old cache keys
    assert _regen_key(RegenConfig(engine="vllm"))["engine"] == "vllm"
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, paths = micro_world
    target = AutoModelForCausalLM.from_pretrained(paths.target_dir)
    tok = AutoTokenizer.from_pretrained(paths.target_dir)
    prompts = datasets.Dataset.from_dict({"prompt_ids": [tok.encode("import os")]})
    with pytest.raises(ValueError, match="engine must be hf or vllm"):
        regenerate(target, tok, prompts, RegenConfig(engine="tgi"), tmp_path, progress=False)


@pytest.mark.vllm
def test_regen_with_vllm_equals_builtin_greedy(micro_world, vllm_available, tmp_path):
    """data.regen.engine=vllm writes the same dataset format, and at T = 0 the same tokens as the built-in engine."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from resispec.data.config import RegenConfig
    from resispec.data.regen import regenerate

    _, paths = micro_world
    target = AutoModelForCausalLM.from_pretrained(paths.target_dir).eval()
    tok = AutoTokenizer.from_pretrained(paths.target_dir)
    texts = ["import os\n", "def f(x):\n    return", "class A:\n", "for i in range("]
    prompts = datasets.Dataset.from_dict({"prompt_ids": [tok.encode(t) for t in texts]})
    regen = RegenConfig(max_new_tokens=16, temperature=0.0, batch_size=4)
    ours = regenerate(target, tok, prompts, regen, tmp_path / "hf", progress=False)
    theirs = regenerate(
        target,
        tok,
        prompts,
        RegenConfig(**{**regen.__dict__, "engine": "vllm"}),
        tmp_path / "v",
        progress=False,
    )
    assert ours.column_names == theirs.column_names == ["prompt_ids", "response_ids"]
    assert ours["prompt_ids"] == theirs["prompt_ids"]
    assert ours["response_ids"] == theirs["response_ids"]


def test_fix_55005_expands_in_place_for_floats():
    """The work-around's expand (per-request value -> its draft positions) writes into the float output itself."""
    import importlib.util
    import sys

    from resispec.vllm_venv import FIX_DIR

    spec = importlib.util.spec_from_file_location("resispec_fix_55005", FIX_DIR / "sitecustomize.py")
    mod = importlib.util.module_from_spec(spec)
    before = list(sys.meta_path)
    spec.loader.exec_module(mod)
    sys.meta_path[:] = before  # the import hook only matters inside a vLLM process
    out = torch.full((6,), float("nan"))
    temps = torch.tensor([0.7, 0.0, 1.3])
    mod._expand_kernel_impl(out, temps, torch.tensor([2, 5, 6], dtype=torch.int32), 0.0, 1.0)
    assert out.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 1.3])

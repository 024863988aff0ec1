"""The real recipes' defects of issue 40 (items 3 and 4), each pinned by a test that failed before its fix:
held-out prompt splits of an ultrachat-shaped dataset, Qwen3's thinking switch, DeepSpeed's batch settings, the
schedule in epochs, export dtype and backend, and the default batches against the memory plan."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

# a Qwen3-style template: the thinking switch is a template variable, on unless the caller says otherwise
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
WORDS = "user assistant system hello world how are you fine thanks question answer the a is what why".split()


def chat_tokenizer():
    """A whitespace word-level tokenizer with ChatML special tokens and a template that reads enable_thinking."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    vocab = {w: i for i, w in enumerate(specials + WORDS + ["\n"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split("\n", behavior="isolated")]
    )
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<|im_end|>"
    )
    out.add_special_tokens({"additional_special_tokens": specials[1:]})
    out.chat_template = THINKING_TEMPLATE
    return out


def conversation(i: int) -> dict:
    return {
        "prompt": f"question {i}",
        "messages": [
            {"role": "user", "content": "hello " + " ".join(WORDS[3 + int(d)] for d in str(i))},
            {"role": "assistant", "content": "fine thanks"},
        ],
    }


def ultrachat_folder(root: Path, rows: int = 40) -> Path:
    """A local dataset folder laid out like HuggingFaceH4/ultrachat_200k on the hub: data/<split>-00000-of-00001
    parquet files for train_sft / test_sft / train_gen / test_gen (no `train` or `test` split)."""
    import datasets

    (root / "data").mkdir(parents=True)
    for n, split in enumerate(("train_sft", "test_sft", "train_gen", "test_gen")):
        ds = datasets.Dataset.from_list([conversation(1000 * n + i) for i in range(rows)])
        ds.to_parquet(str(root / "data" / f"{split}-00000-of-00001.parquet"))
    return root


def ultrachat_data(source: Path, **kw):
    """conf/data/ultrachat.yaml's split settings, on a local folder."""
    from omegaconf import OmegaConf

    from resispec.data.config import DataConfig

    yaml = OmegaConf.load(ROOT / "conf" / "data" / "ultrachat.yaml")
    merged = OmegaConf.merge(OmegaConf.structured(DataConfig), yaml, {"source": str(source), **kw})
    return OmegaConf.to_object(merged)


# ---------------------------------------------------------------- 1. held-out prompt splits


def test_bench_prompts_come_from_ultrachat_split_names(tmp_path):
    """Before: the bench asked for split `test` (ultrachat_200k has none) and a local folder was read as JSON."""
    from resispec.data.prompts import load_heldout_prompts, load_prompts

    folder = ultrachat_folder(tmp_path / "ultrachat")
    tok = chat_tokenizer()
    data = ultrachat_data(folder, num_eval_prompts=4, num_train_prompts=8, seq_len=64)
    bench = load_heldout_prompts(data, tok, None, 3)  # bench/speed.py's call: split `test`
    calib = load_heldout_prompts(data, tok, None, 2, split="eval")  # the server's planner calibration
    assert len(bench) == 3 and len(calib) == 2
    eval_set = {tuple(p) for p in load_prompts(data, tok, "eval")["prompt_ids"]}
    train_set = {tuple(p) for p in load_prompts(data, tok, "train")["prompt_ids"]}
    assert len(eval_set) >= 2 and len(train_set) >= 2
    # test_split = eval_split (test_sft): the bench rows start after the rows the eval set draws from
    src = {tuple(r["prompt_ids"]) for r in load_prompts(data, tok, "eval")}
    assert not ({tuple(p) for p in bench} & src)
    text = tok.decode(bench[0])
    assert text.split()[:2] == ["<|im_start|>", "user"] and text.split()[-2:] == ["<|im_start|>", "assistant"]


def test_missing_split_is_one_line(tmp_path):
    from resispec.data.prompts import DataNotFoundError, load_prompts

    data = ultrachat_data(ultrachat_folder(tmp_path / "u", rows=4), eval_split="validation")
    with pytest.raises(DataNotFoundError, match="split 'validation'") as err:
        load_prompts(data, chat_tokenizer(), "eval")
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- 7. Qwen3's thinking switch


def test_qwen3_recipe_turns_thinking_off_in_prompts_and_server(monkeypatch):
    """Before: no data.chat_template_kwargs; Qwen3's template rendered thinking prompts in the prompt sets and the
    server's chat endpoint alike."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    import resispec.serving.server as srv
    from resispec.data.config import DataConfig
    from resispec.data.prompts import _record_to_prompt
    from resispec.decoding.config import DecodeConfig
    from resispec.models.config import ModelConfig
    from resispec.serving.config import ServerConfig
    from tests.unit.test_serving import FakeEngine

    recipe = OmegaConf.load(ROOT / "conf" / "recipe" / "qwen3.yaml")
    kwargs = OmegaConf.to_container(recipe.data.chat_template_kwargs)
    assert kwargs == {"enable_thinking": False}
    tok = chat_tokenizer()
    data = DataConfig(source="x.jsonl", chat_template_kwargs=kwargs)
    assert tok.decode(_record_to_prompt(data, tok, conversation(1))["prompt_ids"]).endswith("</think>")
    plain = DataConfig(source="x.jsonl")
    assert "<think>" not in tok.decode(_record_to_prompt(plain, tok, conversation(1))["prompt_ids"])

    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64))
    monkeypatch.setattr(srv, "load_pair", lambda *a: (model, model, tok))
    monkeypatch.setattr(srv, "fast_forward", lambda m: m)
    engine = FakeEngine()
    engine.decoder = SimpleNamespace(shape=[1])
    monkeypatch.setattr(srv, "build_engine", lambda *a, **k: engine)
    for cfg, thinks in ((data, False), (plain, True)):
        app = srv.build_app(
            ServerConfig(), DecodeConfig(rule="ar"), ModelConfig(path="t"), ModelConfig(path="d"), data=cfg
        )
        st = app.state.server
        try:
            text = tok.decode(st._encode_chat([("user", "hello")]))
        finally:
            st.worker.close()
        assert text.endswith("</think>") != thinks, text


# ---------------------------------------------------------------- 3. DeepSpeed's batch settings


@pytest.mark.parametrize("name", ["deepspeed_zero2", "deepspeed_zero3"])
def test_deepspeed_configs_get_the_runs_batch_before_prepare(name, monkeypatch):
    """Before: train_micro_batch_size_per_gpu stayed `auto` and prepare(draft, optimizer) refused (no dataloader)."""
    import yaml
    from accelerate.utils import DeepSpeedPlugin

    from resispec.training.distributed import deepspeed_batch_settings

    monkeypatch.delenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", raising=False)
    shipped = yaml.safe_load((ROOT / "recipes" / "accelerate" / f"{name}.yaml").read_text())
    plugin = DeepSpeedPlugin(**shipped["deepspeed_config"])  # what accelerate launch builds from the file
    assert plugin.is_auto("train_micro_batch_size_per_gpu")  # what prepare refused
    deepspeed_batch_settings(plugin.deepspeed_config, 2, 16, 8, 0.5)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        assert not plugin.is_auto(key), key
    assert plugin.get_value("train_micro_batch_size_per_gpu") == 2
    assert plugin.get_value("gradient_accumulation_steps") == 16
    assert plugin.get_value("train_batch_size") == 2 * 16 * 8
    assert plugin.get_value("gradient_clipping") == 0.5


DEEPSPEED_PREPARE = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from resispec.training.distributed import make_accelerator
acc = make_accelerator(cpu=False, mixed_precision="no", grad_accum=2, batch_size=2, grad_clip=1.0)
m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2))
m, opt = acc.prepare(m, torch.optim.AdamW(m.parameters(), lr=1e-3))
x = torch.randint(0, 64, (2, 8))
for _ in range(2):
    with acc.accumulate(m):
        acc.backward(m(input_ids=x, labels=x).loss); opt.step(); opt.zero_grad()
print("prepared", acc.distributed_type.value, type(m).__name__)
"""


@pytest.mark.slow  # ~25 s each (deepspeed's import and its CPU comm op build)
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_prepare_runs_on_one_cpu_process(stage, tmp_path):
    """With deepspeed installed (the `deepspeed` extra): one CPU process prepares the draft and its optimizer
    under ZeRO-`stage` and steps; ~20 s each, skipped without deepspeed."""
    import os
    import subprocess
    import sys

    pytest.importorskip("deepspeed")
    env = {
        **os.environ,
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": str(stage),
        "ACCELERATE_GRADIENT_CLIPPING": "1.0",
        "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false",
        "DS_ACCELERATOR": "cpu",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(29500 + os.getpid() % 1000 + stage),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }
    out = subprocess.run(
        [sys.executable, "-c", DEEPSPEED_PREPARE],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "prepared DEEPSPEED DeepSpeedEngine" in out.stdout


# ---------------------------------------------------------------- 4. the schedule, 8. defaults that fit

REAL_RECIPES = ("llama3", "llama3_lora", "qwen3")


def compose_recipe(recipe: str, *overrides: str):
    from hydra import compose, initialize_config_dir

    from resispec.config import register_configs, to_typed

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return to_typed(compose(config_name="distill", overrides=[f"+recipe={recipe}", *overrides]))


def test_schedule_in_epochs_does_not_scale_with_the_gpu_count():
    from resispec.training.config import OptimConfig, TrainConfig
    from resispec.training.schedule import resolve_schedule

    train = TrainConfig(epochs=2, max_steps=None, batch_size=2, grad_accum=16, num_evals=8, save_every=None)
    optim = OptimConfig(warmup_steps=0, warmup_ratio=0.05)
    one, opt_one, _ = resolve_schedule(train, optim, 64000, 1)
    eight, opt_eight, text = resolve_schedule(train, optim, 64000, 8)
    assert (one.max_steps, eight.max_steps) == (4000, 500)  # the same 2 epochs
    assert (one.eval_every, eight.eval_every) == (500, 63) and eight.save_every == eight.eval_every
    assert (opt_one.warmup_steps, opt_eight.warmup_steps) == (200, 25)
    assert "2.00 epochs" in text
    capped, _, _ = resolve_schedule(dataclasses.replace(train, max_steps=20), optim, 64000, 8)
    assert capped.max_steps == 20  # max_steps caps an epoch-based run (the stand-in's short runs)
    old = TrainConfig(max_steps=150)  # a step-based run (the tiny world) is unchanged
    assert resolve_schedule(old, OptimConfig(), 256, 2)[0] == old


def test_schedule_without_a_length_is_one_line():
    from resispec.training.config import OptimConfig, TrainConfig
    from resispec.training.schedule import ScheduleError, resolve_schedule

    with pytest.raises(ScheduleError, match="train.epochs"):
        resolve_schedule(TrainConfig(max_steps=None), OptimConfig(), 10, 1)


@pytest.mark.parametrize("recipe", REAL_RECIPES)
def test_real_recipes_run_a_few_epochs_and_pick_on_16k_positions(recipe):
    """Before: 4000 steps x 8 x 4 x 8 GPUs = ~51 epochs of 20k prompts; the best checkpoint picked on 1024
    positions."""
    from resispec.training.schedule import resolve_schedule

    c = compose_recipe(recipe)
    assert c.train.eval_positions >= 16384
    assert c.data.num_train_prompts * c.data.regen.max_new_tokens >= 16384
    for gpus in (1, 8):
        train, _, _ = resolve_schedule(c.train, c.optim, c.data.num_train_prompts, gpus)
        epochs = train.max_steps * train.batch_size * train.grad_accum * gpus / c.data.num_train_prompts
        assert 1 <= epochs <= 3, (gpus, epochs)


def _launch_configs():
    return sorted((ROOT / "recipes" / "accelerate").glob("*.yaml"))


@pytest.mark.parametrize("recipe", REAL_RECIPES)
def test_real_recipe_defaults_fit_80_gib_with_every_launch_config(recipe):
    """Before: llama3 at batch 8 x 2048 planned ~97 GiB per device (DDP / one GPU), ~81 GiB under FSDP x8."""
    from resispec.models.hub_configs import shipped_config_dir
    from resispec.training.memory_plan import GIB, model_shape, plan_memory, sharding_from_accelerate_config

    c = compose_recipe(recipe)
    lora = c.draft.adapter == "lora"
    target = model_shape(str(shipped_config_dir(c.target.path)))
    draft = model_shape(
        str(shipped_config_dir(c.draft.path)),
        lora_r=c.draft.lora.r if lora else 0,
        lora_targets=tuple(c.draft.lora.target_modules),
    )
    over = []
    for launch in [None, *_launch_configs()]:
        sharding = sharding_from_accelerate_config(launch)
        sharding = dataclasses.replace(sharding, mixed_precision=c.train.mixed_precision)
        for signal in ("online", "cached"):
            plan = plan_memory(
                target,
                draft,
                sharding,
                target_dtype=c.target.dtype,
                draft_dtype=c.draft.dtype,
                lora=lora,
                batch_size=c.train.batch_size,
                seq_len=c.data.seq_len,
                target_signal=signal,
                cached_top_k=c.train.cached_top_k,
            )
            if plan.total > 80 * GIB:
                over.append(f"{getattr(launch, 'name', 'one device')} {signal}: {plan.total / GIB:.1f} GiB")
    assert not over, over


# ---------------------------------------------------------------- 5. vLLM regeneration before any HF weights


class FakeVllm:
    """Stands in for resispec.vllm_venv.offline_generate: records each call (and the events log), answers
    every prompt with [7, 8, eos]."""

    def __init__(self, events: list):
        self.calls, self.events = [], events

    def __call__(self, model_dir, prompts, *args, engine_args=None, env=None, **kwargs):
        self.events.append("engine")
        self.calls.append(
            {"model": model_dir, "prompts": len(prompts), "engine_args": engine_args, "env": env}
        )
        eos = args[5] if len(args) > 5 else kwargs.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) else eos  # one id or the list of every eos id
        return {"responses": [[7, 8, eos] for _ in prompts], "seconds": 0.0}


def _no_hf_weights(monkeypatch, events: list):
    """Any HF weight load appends to `events` (and the test checks the order)."""
    import transformers

    real = transformers.AutoModelForCausalLM.from_pretrained

    def loading(*args, **kwargs):
        events.append("hf weights")
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loading)


def _jsonl_prompts(path: Path, n: int = 6) -> Path:
    import json

    path.write_text("".join(json.dumps({"prompt": f"w{2 + i} w{3 + i} w{4 + i}"}) + "\n" for i in range(n)))
    return path


def test_generate_with_vllm_loads_no_hf_weights(tmp_path, monkeypatch):
    """Before: train/generate.py loaded the HF target (onto the GPU) before regeneration started vLLM."""
    import importlib.util

    import resispec.data.regen as peer
    from tests.unit.test_training_helpers import save_pair

    target, _ = save_pair(tmp_path / "pair")
    events: list = []
    fake = FakeVllm(events)
    monkeypatch.setattr(peer, "offline_generate", fake)
    _no_hf_weights(monkeypatch, events)
    data = f"data.source={_jsonl_prompts(tmp_path / 'p.jsonl')}"
    c = compose_recipe("debug", f"target.path={target}", data, f"data.cache_dir={tmp_path / 'cache'}")
    c = dataclasses.replace(
        c, data=dataclasses.replace(c.data, regen=dataclasses.replace(c.data.regen, engine="vllm"))
    )
    spec = importlib.util.spec_from_file_location("generate_script", ROOT / "train" / "generate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.generate(c)
    assert events == ["engine", "engine"]  # train and eval; no HF copy of the target at all
    assert all(call["model"] == str(target) for call in fake.calls)


def test_distill_with_vllm_regenerates_before_loading_the_pair(tmp_path, monkeypatch):
    from accelerate import Accelerator

    import resispec.data.regen as peer
    from resispec.data.config import DataConfig, RegenConfig
    from resispec.models.config import ModelConfig, WorldConfig
    from resispec.training.loop import _load_inputs
    from tests.unit.test_training_helpers import save_pair

    target, draft = save_pair(tmp_path / "pair")
    events: list = []
    monkeypatch.setattr(peer, "offline_generate", FakeVllm(events))
    _no_hf_weights(monkeypatch, events)
    data = DataConfig(
        source=str(_jsonl_prompts(tmp_path / "p.jsonl")),
        num_train_prompts=4,
        num_eval_prompts=2,
        seq_len=32,
        cache_dir=str(tmp_path / "cache"),
        regen=RegenConfig(max_new_tokens=4, engine="vllm"),
    )
    pair = (ModelConfig(path=str(target), device="cpu"), ModelConfig(path=str(draft), device="cpu"))
    out = _load_inputs(Accelerator(cpu=True), WorldConfig(), *pair, data, None)
    assert events[:2] == ["engine", "engine"] and set(events[2:]) == {"hf weights"}
    assert list(out[3][0]["response_ids"]) == [7, 8, 1]


def test_vllm_regeneration_is_data_parallel_over_the_gpus(monkeypatch):
    """One engine per visible GPU (vLLM's LLM refuses data_parallel_size in one process), CUDA graphs on."""
    import resispec.data.regen as peer
    from resispec.data.config import RegenConfig
    from resispec.data.regen import _vllm_responses

    fake = FakeVllm([])
    monkeypatch.setattr(peer, "offline_generate", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5,7")
    prompts = [[i] for i in range(7)]
    out = _vllm_responses("m", prompts, RegenConfig(), eos_id=1)
    assert len(out) == 7
    assert sorted(c["env"]["CUDA_VISIBLE_DEVICES"] for c in fake.calls) == ["2", "5", "7"]
    assert sorted(c["prompts"] for c in fake.calls) == [2, 2, 3]
    assert all(c["engine_args"] == {"enforce_eager": False} for c in fake.calls)


def test_regeneration_stops_at_every_eos_id_of_the_generation_config():
    """Llama 3 ends a turn with <|eot_id|> (the tokenizer's eos) but also stops at <|end_of_text|> and <|eom_id|>
    (generation_config.eos_token_id): a response is cut after the first of any of them, as HF generate stops."""
    from types import SimpleNamespace

    from resispec.data.config import RegenConfig
    from resispec.data.regen import _generate_batch, eos_ids

    target = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[11, 12, 13]))
    tokenizer = SimpleNamespace(eos_token_id=13)
    assert eos_ids(tokenizer, target) == [13, 11, 12]

    class Fake(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def generate(self, input_ids, eos_token_id, **kw):
            assert sorted(eos_token_id) == [11, 12, 13]  # generate stops on every one
            new = torch.tensor([[5, 11, 6, 0], [5, 6, 12, 0], [5, 6, 7, 8]])
            return torch.cat([input_ids, new], dim=1)

    out = _generate_batch(
        Fake(), [[1, 2], [3], [4]], RegenConfig(), pad_id=0, eos_id=eos_ids(tokenizer, target)
    )
    assert out == [[5, 11], [5, 6, 12], [5, 6, 7, 8]]

"""Pieces of the training loop: simulated tau, the data stream, the schedule, atomic checkpoints, pointers."""

from __future__ import annotations

import json

import pytest
import torch

from resispec.decoding.config import DecodeConfig
from resispec.training import checkpoint as ckpt
from resispec.training.config import OptimConfig
from resispec.training.evaluation import closed_form_rules, evaluate, select_positions, simulate_tau
from resispec.training.loop import batch_indices, lr_lambda


def test_simulated_tau_constant_alpha_is_a_geometric_sum():
    a = 0.7
    alphas = [torch.full((10,), a) for _ in range(3)]
    tau, per_depth = simulate_tau(alphas, [10])
    assert tau == pytest.approx(1 + a + a**2 + a**3)
    assert per_depth == pytest.approx([a, a, a])


def test_simulated_tau_follows_the_positions_of_each_window():
    """Windows never cross sequences; depth d of the window at s uses position s + d."""
    seq0 = torch.tensor([1.0, 0.5, 0.0])  # windows of depth 2: (1, .5) -> 1 + 1 + .5; (.5, 0) -> 1.5
    seq1 = torch.tensor([0.2])  # too short for a depth-2 window: ignored
    alpha = torch.cat([seq0, seq1])
    tau, per_depth = simulate_tau([alpha, alpha], [3, 1])
    assert tau == pytest.approx(((1 + 1 + 0.5) + (1 + 0.5 + 0)) / 2)
    assert per_depth == pytest.approx([0.75, 0.25])


def test_simulated_tau_is_one_for_a_useless_draft():
    assert simulate_tau([torch.zeros(5)] * 4, [5])[0] == 1.0


def test_batch_stream_is_a_function_of_the_step_and_splits_ranks():
    a = [batch_indices(s, 4, 2, r, 16, seed=3) for s in range(2) for r in range(2)]
    b = [batch_indices(s, 4, 2, r, 16, seed=3) for s in range(2) for r in range(2)]
    assert a == b
    flat = [i for x in a for i in x]  # one epoch of 16 rows: every row exactly once across steps and ranks
    assert sorted(flat) == list(range(16))
    assert batch_indices(0, 4, 1, 0, 16, seed=4) != batch_indices(0, 4, 1, 0, 16, seed=3)


def test_lr_schedule_warms_up_then_decays():
    f = lr_lambda(OptimConfig(warmup_steps=4, schedule="cosine"), max_steps=20)
    assert [f(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert f(20) == pytest.approx(0.1) and f(12) < f(5)
    assert lr_lambda(OptimConfig(warmup_steps=0, schedule="constant"), 20)(15) == 1.0


def test_eval_on_identical_models_accepts_everything():
    """Draft = target: alpha = 1 for every closed-form rule except onehot-like top-n ones, tau = depth + 1."""
    from tests.unit.test_training_helpers import make_micro_llama

    model = make_micro_llama(0, 16, 1).eval()
    seqs = select_positions([([2, 3, 4], [5, 6, 7, 8, 9])], max_positions=100)
    out = evaluate(
        model, model, seqs, DecodeConfig(tree=[2, 1], rule="resispec"), rules=["chain", "resispec"]
    )
    assert out["num_positions"] == 5
    for rule in ("chain", "resispec"):
        assert out["alpha"][rule]["1"] == pytest.approx(1.0, abs=1e-5)
        assert out["tau"][rule] == pytest.approx(3.0, abs=1e-4)
    assert out["fkl"] == pytest.approx(0.0, abs=1e-5)


def test_closed_form_rules_skip_the_sampled_ones():
    rules = closed_form_rules([1, 2, 4])
    assert "resispec" in rules and "rrs" in rules
    assert "rsd" not in rules and "gumbel" not in rules
    from resispec.verify import VERIFIERS

    p, q = torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([[0.2, 0.3, 0.5]])
    assert "greedy" not in rules and "resispec_auto" in rules  # auto is scored by its declared surrogate
    for rule in rules:  # every listed rule really has its training value at every n asked for
        for n in (1, 2, 4):
            VERIFIERS[rule].surrogate_acceptance(p, q, n)


def test_select_positions_stops_at_the_budget():
    rows = [([1], [2, 3, 4]), ([1], []), ([5, 6], [7, 8, 9])]
    seqs = select_positions(rows, max_positions=5)
    assert [(s.tolist(), n) for s, n in seqs] == [([1, 2, 3, 4], 1), ([5, 6, 7, 8], 2)]


class _FakeAccelerator:
    """Single-process stand-in for the parts of Accelerator that checkpointing uses."""

    is_main_process = True
    num_processes = 1
    device = torch.device("cpu")

    def wait_for_everyone(self):
        pass

    def save_state(self, path):
        torch.save({"w": 1}, f"{path}/model.bin")


def test_save_state_is_atomic_and_rotates(tmp_path, monkeypatch):
    acc = _FakeAccelerator()
    root = tmp_path / "checkpoints"
    for step in (5, 10, 15):
        ckpt.save_state(acc, root, step, keep=2)
    assert ckpt.checkpoint_steps(root) == [10, 15]
    assert (ckpt.step_dir(root, 15) / "COMPLETE").read_text() == "15"
    # a write interrupted before the rename leaves only a temporary folder, which is never listed
    (root / ".tmp-step_0000020").mkdir()
    assert ckpt.checkpoint_steps(root) == [10, 15]
    ckpt.clean_temporaries(root)
    assert sorted(p.name for p in root.iterdir()) == ["step_0000010", "step_0000015"]


def test_latest_pointer_and_resume_dir(tmp_path):
    base = tmp_path / "outputs" / "distill" / "debug"
    old, new = base / "2026-01-01_00-00-00", base / "2026-01-02_00-00-00"
    (old / "checkpoints" / "step_0000005").mkdir(parents=True)
    new.mkdir(parents=True)
    assert ckpt.find_resume_dir(new) == old
    ckpt.update_latest(old)
    ckpt.update_latest(new)
    assert (base / "latest").resolve() == new.resolve()
    assert json.loads((base / "latest.json").read_text())["draft"].endswith("2026-01-02_00-00-00/draft")
    assert ckpt.find_resume_dir(tmp_path / "nowhere" / "x") is None


def test_sync_flag_single_process():
    assert ckpt.sync_flag(_FakeAccelerator(), True) is True
    assert ckpt.sync_flag(_FakeAccelerator(), False) is False

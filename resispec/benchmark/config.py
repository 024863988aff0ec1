"""Typed config for the benchmark (Hydra group `bench`): speed, load, in-process comparison, vLLM peer."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BenchConfig:
    num_prompts: int = 8  # speed bench: prompts per round (bench.rounds)
    warmup: int = 1  # warm-up generations per method before timing (never timed)
    max_new_tokens: int = 64
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    # the rules timed per draft and tree; at temperature 0, where every rule is argmax matching over the draft's
    # top-b, one row a tree with rule "greedy" (speed.rules_at; plan_rules alike)
    rules: list[str] = field(
        default_factory=lambda: [
            "chain",
            "rrs",
            "kseq",
            "rsd",
            "hub",
            "gumbel",
            "onehot",
            "resispec",
            "resispec_auto",
        ]
    )
    trees: list[list[int]] = field(default_factory=lambda: [[1, 1, 1, 1], [4, 2, 1, 1]])
    hf_assisted: bool = True
    hf_num_assistant_tokens: list[int] | None = None  # chain lengths tried for HF; null = lengths of `trees`
    drafts: dict[str, str] = field(default_factory=dict)  # extra drafts to compare: label -> path
    # per-draft rules (label -> rules) where a draft needs fewer rows than `rules`, e.g. the main job's
    # {initial: [chain, resispec]}: the initial draft is the before, not the object of the comparison
    draft_rules: dict[str, list[str]] = field(default_factory=dict)
    draft_label: str = "draft"  # label of the configured `draft` in the report
    server_url: str | None = None  # load-test a running server instead (localhost only)
    # several running servers compared in one run: "LABEL=URL" (or a URL, labelled by its host:port), every level swept
    # on each in turn (ABBA over bench.rounds), merged per (server, level); the report adds their ratios to the first
    server_urls: list[str] = field(default_factory=list)
    concurrency: int = 8
    num_requests: int = 32
    concurrencies: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])  # the load sweep's levels
    ignore_eos: bool = True  # load test: every request runs to max_tokens, so lost tokens show
    # load test: 0 = every request asks max_new_tokens; r > 0 = request i asks a length drawn uniformly from
    # [max_new_tokens (1 - r), max_new_tokens (1 + r)], the same on every server (vLLM's --random-range-ratio).
    # (equal lengths let batched AR rows run in lockstep waves; four runs did not show that it matters beyond the
    # run-to-run noise: docs/journal/vllm.md, "Unequal request lengths")
    output_len_range_ratio: float = 0.0
    # rounds of the whole measurement, merged; on a machine whose speed drifts within minutes one round is noise.
    # Speed bench: each round its own num_prompts prompts, each through every method in turn, the order reversed every
    # other round (report: each row's round-to-round spread). Load sweep and in-process comparison (python
    # bench/load.py): every server or mode in turn at each level, merged per (server, level). conf/bench/default.yaml: 2
    rounds: int = 1
    # in-process comparison: the serving modes to compare (labels of benchmark.inprocess.serving_modes); empty = all five
    modes: list[str] = field(default_factory=list)
    # load test: each request carries a seed (bench.seed + i); false sends unseeded requests, as most clients do (our
    # server decodes a seeded request with server.seeded_sampling)
    seeded_requests: bool = True
    seed: int = 0
    output_dir: str | None = None  # default: the Hydra run folder
    # tree=auto rows: for each of these rules the planner (resispec/decoding/planner/) picks the tree from this
    # device's measured costs and the rule's calibrated acceptance; the report shows predicted vs measured
    plan_rules: list[str] = field(default_factory=lambda: ["resispec", "resispec_auto"])
    # validation prompts for the planner (Planner): the first 4 calibrate and choose, the next 8 re-measure the
    # choice, and at T = 0 every one counts tau (greedy_tau)
    plan_calibration_prompts: int = 96
    # tree=auto head-to-head after the sweep (speed.confirm_plans): AR, each planned row and the best fixed row of its
    # rule (the sweep's pick) timed again on the first round's prompts, interleaved per prompt, each call's fastest of
    # this many repeats; 0 = off. It re-measures the sweep's winner, whose luck the sweep's max keeps.
    plan_confirm_repeats: int = 0
    # the head-to-head's prompts: the first this many bench prompts; 0 = the first round's (bench.num_prompts). Two
    # identical decodes read within 5% in 10 of 10 trials at 12 prompts x 3 repeats, in 8 of 10 at 6 x 2
    # (bench/experiments/h2h_noise.py; docs/decoder_speed.md)
    plan_confirm_prompts: int = 0
    # each planned tree and the best fixed tree of its rule counted on this many test prompts, the bench's first
    # (speed.check_plans_on_pool: T = 0 any tree by greedy replay, T > 0 chains by the product model), the timed
    # speedups carried to their tau, so the plan, its prediction and the best fixed row compare beyond the few
    # prompts timed; 0 = off
    plan_check_prompts: int = 0
    # also time the decoder on the HF forward (fast_forward=False) for every rule x tree, interleaved: the fast
    # forward's before/after in one run ("ref[...]" rows; the reference step itself is tests/oracle_decoder.py)
    reference_step: bool = False
    # time a random-weight pair shaped like the tiny world (no built world, random prompts): speed only, tau is noise
    random_pair: bool = False
    # vLLM as a peer (resispec/benchmark/vllm_peer.py; needs scripts/setup_vllm.sh): vLLM AR and vLLM with each draft
    vllm: bool = False
    vllm_python: str | None = None  # the vLLM venv's python; null = $RESISPEC_VLLM_PYTHON or .venv-vllm
    vllm_k: list[int] | None = None  # chain lengths; null = those of the chain trees in `trees`, else [2]
    vllm_drafting: list[str] = field(default_factory=lambda: ["greedy", "probabilistic"])
    vllm_env: dict[str, str] = field(default_factory=dict)  # extra env for the servers
    vllm_args: list[str] = field(default_factory=list)  # extra server arguments, e.g. [--enforce-eager]
    # work around vllm#55005 (CPU, T > 0, draft); rows labelled +fix#55005
    vllm_fix_cpu_sampling: bool = False

"""The benchmark (F5): measures the decoders and the server; nothing in the library imports it.

- results.py: `BenchRow`, `Method`, `LoadTestResult`, `merge_rounds`, `percentile`, `sum_stats`;
- speed.py: `run_bench(...)` / `bench_pair(...)`: AR vs every rule x tree (per draft), the planner's trees, HF
  assisted generation and the vLLM peer, same prompts and seeds (bench/speed.py);
- load.py: `run_load_test`, `run_load_sweep`, `run_interleaved`: streaming clients against running servers
  (bench/load.py --server ...); inprocess.py: `compare_in_process`, every serving mode in one process (bench/load.py);
- vllm_peer.py: vLLM's rows in the speed bench (its peer check on `resispec.sampling`'s filter) and its load sweep;
- report.py: the tables, plots, report files and W&B; config.py: `BenchConfig`.
"""

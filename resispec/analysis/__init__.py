"""Applications over the library: they load models, compose configs, plot and write reports. Nothing in
resispec/ below this layer imports it.

    python bench/headroom.py [+recipe=NAME] [headroom.key=value ...]   # analysis/headroom.py: alpha per rule vs bounds
    python bench/verify_speed.py [--device cuda]                       # verification throughput per rule
    python bench/compare.py outputs/distill/tiny_*/latest              # held-out tau of finished distillation runs
"""

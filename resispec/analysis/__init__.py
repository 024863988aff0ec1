"""Applications over the library: they load models, compose configs, plot and write reports. Nothing in
resispec/ below this layer imports it.

    python serve/headroom.py [+recipe=NAME] [headroom.key=value ...]   # analysis/headroom.py: alpha per rule vs bounds
    python -m resispec.analysis.verify_speed [--device cuda]           # verification throughput per rule
    python -m resispec.analysis.compare outputs/distill/tiny_*/latest  # held-out tau of finished distillation runs
"""

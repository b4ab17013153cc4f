"""The main job (command: `python -m examples.train_moe`, `__main__.py`, whose docstring is its
--help): `job.py` (`train`: config to metrics, plot and checkpoint; the command line) and its
parts: `config.py` (the config and its checks), `flags.py` (the command line's flags),
`checkpoint.py`, `loop.py`, `step.py` (the compiled program), `report.py` (metrics.json, the
plot), `rebalance.py` (expert load balancing) and `replan.py` (re-planning cross-DC domains).
"""

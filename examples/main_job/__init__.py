"""The main job (command: examples/train_moe.py): `main_job.py` (`train`: config to metrics, plot
and checkpoint) and its parts: `train_config.py` (the config and its checks), `train_flags.py`
(the command line), `train_checkpoint.py`, `train_loop.py`, `train_step.py` (the compiled
program), `train_report.py` (metrics.json, the plot), `rebalance_hook.py` (expert load balancing)
and `replan_hook.py` (re-planning cross-DC domains).
"""

"""The cross-DC job (command: `python -m examples.cross_dc`, `__main__.py`, whose docstring is its
--help), where it differs from the main job, whose `train` it runs: `job.py` (its modes: plan, SR
table, re-planning; the command line), `settings.py` (its flags and the cluster they describe)
and `crossing.py` (the bytes crossing the DC level, measured and predicted).
"""

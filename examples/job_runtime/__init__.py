"""The command-line job both training jobs run in, as one process or several on
`jax.distributed`: `run_job.py` (the job from start to its one-line end), `startup.py` (the
process flags, start-up and its checks), `processes.py` (agreement, decisions, liveness, output),
`preemption.py` (SIGTERM: stop after a step with a committed checkpoint), `output_lock.py` (one job
per output directory), `errors.py` (the errors that end a job in one line), `flag_fields.py`
(flags made from config fields: each setting written once) and `jax_private.py` (the private jax
API start-up and agreement need). Each job passes its own name, which starts every line it ends
with.
"""

"""Where the cross-DC job (command: examples/cross_dc.py) differs from the main job, whose `train`
it runs: `cross_dc_job.py` (its modes: plan, SR table, re-planning), `cross_dc_settings.py` (its
flags and the cluster they describe) and `cross_dc_bytes.py` (the bytes across the DC level,
measured and predicted).
"""

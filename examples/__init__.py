"""The examples: two training jobs of one MoE LM, and three standalone examples.

Each command is a script at the top of this folder; the two jobs' code lives in packages beside:

* `train_moe.py`: the main job, `main_job/main_job.py` (`train`), its parts beside it in
  `main_job/` (config, flags, checkpoint, loop, compiled step, report, re-balancing, re-planning).
* `cross_dc.py`: the cross-DC job, the main job's `train` on a described cluster; where it
  differs (its settings, the bytes it reports, its modes) is `cross_dc_job/`.
* What both jobs share: the model and its data, `moe_lm/`; the multi-process command-line job
  they run in (start-up, agreement, liveness, SIGTERM, the output directory's lock, one-line
  errors), `job_runtime/`.
* Standalone, one file each: `quickstart.py` (dispatch -> expert FFN -> combine),
  `traffic_report.py` (hierarchical vs flat inter-node copies), `hf_moe_layer.py` (every
  HuggingFace MoE family through `nn.MoEBlock`).

The scripts run by path (`python examples/train_moe.py`); the packages import as
`examples.<package>.<module>` from the repository root (the tests do).
"""

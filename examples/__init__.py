"""The examples: two training jobs of one MoE LM, and three standalone examples.

Each job is a package run as a module from the repository root, named as the command that runs it
(its `__main__.py`, whose docstring is its --help); the standalone examples are one script each:

* `python -m examples.train_moe`: the main job, `train_moe/` (`job.py`: `train` and the command
  line; its parts beside it: config, flags, checkpoint, loop, compiled step, report,
  re-balancing, re-planning).
* `python -m examples.cross_dc`: the cross-DC job, the main job's `train` on a described cluster;
  where it differs (its settings, the bytes it reports, its modes) is `cross_dc/`.
* What both jobs share: the model, its config and its data, `moe_lm/`; the multi-process
  command-line job they run in (start-up, agreement, liveness, SIGTERM, the output directory's
  lock, one-line errors), `job_runtime/`.
* Standalone, by path: `python examples/quickstart.py` (dispatch -> expert FFN -> combine),
  `examples/traffic_report.py` (hierarchical vs flat inter-node copies), `examples/hf_moe_layer.py`
  (every HuggingFace MoE family through `nn.MoEBlock`).

Run with `-m`, a job's package imports as `examples.<package>.<module>` with the repository root on
`sys.path` as Python puts it there (the current directory), as the tests import it; nothing edits
`sys.path`.
"""

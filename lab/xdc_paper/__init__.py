"""The HybridEP paper (arXiv 2510.19470) reproduced by the package's cost model (numpy, no JAX;
laboratory: it imports `jax_hybridep.xdc.model`, the package never imports it):

* `tables`: the paper's numbers (Tables IV, V, VII, the sweep and the ablation) and the fit of
  Table V;
* `reproduction`: the expert-size sweep, the ablation, the tables of docs/crossdc_model.md and the
  pass / fail tiers;
* `python -m lab.xdc_paper` (`__main__`): prints them and writes every Table V point.
"""

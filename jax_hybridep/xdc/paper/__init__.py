"""The HybridEP paper (arXiv 2510.19470) reproduced by this package's cost model (host-side numpy;
it depends on `xdc.model`, nothing depends on it):

* `tables`: the paper's numbers (Tables IV, V, VII, the sweep and the ablation) and the fit of
  Table V;
* `reproduction`: the expert-size sweep, the ablation, the tables of docs/crossdc_model.md and the
  pass / fail tiers;
* `python -m jax_hybridep.xdc.paper` (`__main__`): prints them and writes every Table V point.
"""

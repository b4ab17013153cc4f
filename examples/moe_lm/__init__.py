"""The MoE LM both training jobs train: the byte-level decoder-only transformer whose FFNs are
`jax_hybridep.nn.MoEBlock`s, its config and its mesh (`model.py`), and its data, the Python
standard library's own source, fed per process (`data.py`).
"""

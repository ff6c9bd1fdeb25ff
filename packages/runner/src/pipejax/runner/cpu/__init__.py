"""The CPU backend of the runner: hand-written kernels that replace parts of ``model.py``'s XLA formulation on
XLA:CPU (XLA FFI custom calls compiled by numba), the panel layout of the dense kernel's weights, per-layer
views of a stage's weights, XLA's few-row dots choice, and ``select``, which decides by measurement on the host
at hand which of them a stage runs. Nothing here is imported by ``model.py``: the runner hands the selected
kernels in (``model.Kernels``)."""

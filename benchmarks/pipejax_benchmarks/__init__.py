"""pipejax's whole-system benchmarks: the report (``report``) and its sections (``sections``).

An unpublished package at the repository root, outside every layer: no ``pipejax.*`` source imports it
(``.importlinter``). A layer's own benchmarks stay in its ``packages/<layer>/benchmarks``; the report runs
them and renders what they write.
"""

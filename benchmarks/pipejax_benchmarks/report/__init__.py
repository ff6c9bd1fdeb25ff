"""The benchmark report: run every benchmark section in its own process and write BENCHMARKS.md (and a
PNG of throughput vs concurrency) from what they measured — each figure next to its reference, measured
in the same run, medians over repeats with min–max. Nothing in the report is typed in by hand: every
number comes from the sections' JSON, and a goal that is not met says so, with what bounds it.

    python benchmarks/report.py [--quick] [--repeats N] [--output BENCHMARKS.md] [--sections a,b]
    python benchmarks/report.py --from-results DIR   # re-render a previous run's JSON
    nox -s bench_report                               # the same, in its own venv

Each section is a module of ``pipejax_benchmarks.sections``, run as
``python -m pipejax_benchmarks.sections.<name>`` with benchmarks/ on ``PYTHONPATH``.

The parts: ``catalog`` (the sections), ``run`` (running them, the command line), ``render`` (the report
assembled), one renderer module per group of sections (``throughput``, ``decode``, ``engine``), ``prose``
(the decode findings' longer text), ``text`` (formatting) and ``plot``.
"""

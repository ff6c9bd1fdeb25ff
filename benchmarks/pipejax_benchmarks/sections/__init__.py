"""The sections of ``pipejax bench report``: each one a module run in its own process
(``python -m pipejax_benchmarks.sections.<section> --json OUT``, from benchmarks/) that measures a figure and its
reference in the same run and writes them as JSON; ``bench_report`` renders BENCHMARKS.md from them."""

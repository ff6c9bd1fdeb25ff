"""The start-up line of ``pipejax generate``: phases across stages, programs counted once per process."""

from pipejax.ray_executor.executor.startup import StartupReport
from pipejax.worker.compile_stats import CompileStats


def test_phases_span_the_stages_and_shared_processes_count_once():
    timings = [{"init": (0.0, 1.0), "load": (1.0, 4.0), "warmup": (5.0, 9.0)},
               {"init": (0.5, 1.5), "load": (1.5, 6.0), "warmup": (5.0, 10.0)},
               {"init": (0.0, 0.2), "load": (2.0, 3.0)}]
    compiles = [CompileStats(10, 4, 3.0), CompileStats(6, 2, 2.0), CompileStats(5, 5, 0.5)]
    report = StartupReport.from_stages(timings, compiles, [("a", 1), ("a", 1), ("b", 7)])
    assert report.phases == {"init": 1.5, "load": 5.0, "warmup": 5.0}
    assert report.compiles == (CompileStats(10, 4, 3.0), CompileStats(5, 5, 0.5))
    line = report.describe(12.34)
    assert line == ("start-up 12.3s: stage init 1.5s, weights 5.0s, warm-up 5.0s, 15 XLA programs (6 compiled, "
                    "9 from the compilation cache; 3.0s in the busiest of 2 processes)")

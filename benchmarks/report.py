"""The benchmark report (see ``pipejax_benchmarks.report``):

    python benchmarks/report.py [--quick] [--repeats N] [--output BENCHMARKS.md] [--sections a,b]
    python benchmarks/report.py --from-results DIR   # re-render a previous run's JSON
"""

import sys

from pipejax_benchmarks.report.run import main

if __name__ == "__main__":
    sys.exit(main())

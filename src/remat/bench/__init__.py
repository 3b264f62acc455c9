"""``remat.bench``, the bench wing: remat beside today's options, measured side by side.

``_run`` takes the numbers (NOTE [How the numbers are taken]), ``_max_batch`` searches the
largest batch that fits a budget, ``_setups`` are the setups compared, ``_rounds`` the
interleaved timing rounds, ``_rows`` and ``_report`` the results and their rendering,
``_timeline`` the memory timeline picture. The models come from :mod:`remat.zoo`, beside
this wing.
"""

from remat.bench._max_batch import max_batch, search_max
from remat.bench._report import BenchReport
from remat.bench._rows import BenchRow, MaxBatchResult
from remat.bench._run import QUICK, bench_model, run_bench
from remat.bench._timeline import plot_timeline

__all__ = [
    "BenchReport",
    "BenchRow",
    "MaxBatchResult",
    "bench_model",
    "max_batch",
    "plot_timeline",
    "run_bench",
    "search_max",
    "QUICK",
]

"""Rebuilding runs from their records: `worldpipe rerun` (bit-identical?) and `worldpipe resume` (continue).

Orchestration, not tracking: it reads MLflow records through :mod:`worldpipe.tracking.history`, finds or rebuilds
the dataset in-process, and trains through the same launcher as `worldpipe train`.
"""

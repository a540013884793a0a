"""Layer 2: thin Prefect tasks, one per stage of the DAG.

    calibration_stats -> layer_rotation (per layer) -> layer_basis (per layer) -> export_checkpoint
    -> perplexity / benchmarks -> sweep points, figures -> table

Every task reads and writes artifacts through `tasks.artifacts` (one store, content hashes) and is
cached on a key made of its inputs' content hashes, its parameters and the source of the library
code it runs (`artifacts.cached_task`). Importing this package sets Prefect's local defaults
(`tasks._env`) before Prefect itself is imported.
"""

from . import _env  # noqa: F401  (must run before `import prefect`)

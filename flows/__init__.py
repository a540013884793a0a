"""Layer 3: Prefect flows that read like the DAG; `dvc.yaml` stages call them (`python -m flows.X`).

    calibrate  -> convert (per method x budget) -> evaluate -> figures -> report
    paper      = all of the above in one process;  nightly = convert + evaluate a watch list
"""

import tasks._env  # noqa: E402,F401  (Prefect's local defaults, before any `import prefect`)

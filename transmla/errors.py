"""User-facing errors.

Every error a user can cause (bad source string, missing file, impossible rank, ...) is raised as a
`TransMLAError` whose message says what went wrong *and* how to fix it. The CLI prints it as one line
and exits non-zero; tracebacks are reserved for bugs.
"""


class TransMLAError(Exception):
    """An error caused by input, with the fix in its message."""

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(problem if fix is None else f"{problem} Fix: {fix}")

"""What the benchmark scripts share: report names made from a model source, and one-line errors.

Imported as `from _common import ...`: scripts/ is sys.path[0] when a script runs as `python scripts/X.py`,
and each script inserts it itself too (the tests load scripts by file path).
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def report_stem(model: str) -> str:
    """A report's file name for `model`: a catalog-style name (smollm2-135m) as it is, so the committed reports
    keep their names; any other source (a directory, `dir:`/`hf:` ones) one safe path component. Joined as it
    was, an absolute path dropped the reports folder (the report landed beside the model) and `dir:` made
    nested folders named after the prefix."""
    if SAFE.fullmatch(model):
        return model
    return re.sub(r"[^A-Za-z0-9._-]+", "_", model).strip("._-") or "model"


def check_report_out(ap, out: Path) -> Path:
    """Refuse now, through `ap`, a report path the script could not write at its end (a directory): `out` (.json)
    and the .md written beside it. Returns `out`."""
    from transmla.errors import TransMLAError
    from transmla.io.paths import check_output

    try:
        for f in (out, out.with_suffix(".md")):
            check_output(f, "file")
    except TransMLAError as e:
        ap.error(str(e))
    return out


def run(main) -> None:
    """Run a script's main() and exit with its return value; a TransMLAError (a bad --model: no such path, not a
    model source, not an MLA model) is one line on stderr and exit status 2, as `transmla` prints its errors,
    not a traceback."""
    from transmla.errors import TransMLAError

    try:
        code = main()
    except TransMLAError as e:
        print(f"{Path(inspect.getfile(main)).name}: error: {e}", file=sys.stderr)
        code = 2
    raise SystemExit(code)

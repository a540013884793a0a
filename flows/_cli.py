"""Shared command-line plumbing for `python -m flows.<name>`: --params, -S overrides, one-line errors."""

from __future__ import annotations

import argparse
import sys

import tasks  # noqa: F401  (Prefect defaults before prefect is imported)
from transmla.errors import TransMLAError

from .params import DEFAULT_PARAMS, Profile, load_profile


def parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--params", default=str(DEFAULT_PARAMS.relative_to(DEFAULT_PARAMS.parents[1])),
                    help="profile YAML (default params/default.yaml)")
    ap.add_argument("-S", "--set", action="append", default=[], metavar="KEY=YAML",
                    help="override one param, e.g. -S evaluation.limit=5 (validated like the file)")
    return ap


def variant_parser(description: str) -> argparse.ArgumentParser:
    """parser() plus the --model/--method/--budget that name one converted model of the params."""
    ap = parser(description)
    ap.add_argument("--model", required=True, help="a model name from the params' models:")
    ap.add_argument("--method", required=True, choices=["transmla", "mha2mla"])
    ap.add_argument("--budget", required=True, type=float, help="KV-cache fraction kept, e.g. 0.125")
    return ap


def overrides_of(args) -> dict:
    """-S KEY=YAML options as {dotted key: value}."""
    import yaml

    overrides = {}
    for kv in args.set:
        if "=" not in kv:
            raise TransMLAError(f"-S {kv!r} is not KEY=VALUE.", "write e.g. -S evaluation.limit=5.")
        k, v = kv.split("=", 1)
        overrides[k] = yaml.safe_load(v)
    return overrides


def profile_of(args) -> Profile:
    return load_profile(args.params, overrides_of(args))


def run(main) -> None:
    """Run `main()`; a TransMLAError becomes one line with its fix and exit code 2."""
    try:
        main()
    except TransMLAError as e:
        print(f"transmla: error: {e}", file=sys.stderr)
        sys.exit(2)

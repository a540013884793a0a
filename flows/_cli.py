"""Shared command-line plumbing for `python -m flows.<name>`: --params, -S overrides, one-line errors."""

from __future__ import annotations

import argparse
import sys

import tasks  # noqa: F401  (Prefect defaults before prefect is imported)
from transmla.errors import TransMLAError

from .params import DEFAULT_PARAMS, ROWS, Profile, check_budget, load_profile


def parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--params", default=str(DEFAULT_PARAMS.relative_to(DEFAULT_PARAMS.parents[1])),
                    help="profile YAML (default params/default.yaml)")
    ap.add_argument("-S", "--set", action="append", default=[], metavar="KEY=YAML",
                    help="override one param, e.g. -S finetune.max_tokens=61440 (validated like the file)")
    return ap


def variant_parser(description: str, original: bool = False) -> argparse.ArgumentParser:
    """parser() plus the --model/--method/--budget that name one converted model of the params
    (`original`: or the unconverted model, --method original without a budget)."""
    ap = parser(description)
    ap.add_argument("--model", required=True, help="a model name from the params' models:")
    ap.add_argument("--method", required=True, choices=(["original"] if original else []) + list(ROWS))
    ap.add_argument("--budget", required=not original, type=float, help="KV-cache fraction kept, e.g. 0.125")
    return ap


def overrides_of(args) -> dict:
    """-S KEY=YAML options as {dotted key: value}."""
    import yaml

    overrides = {}
    for kv in args.set:
        if "=" not in kv:
            raise TransMLAError(f"-S {kv!r} is not KEY=VALUE.", "write e.g. -S finetune.max_tokens=61440.")
        k, v = kv.split("=", 1)
        try:
            overrides[k] = yaml.safe_load(v)
        except yaml.YAMLError as e:
            problem = " ".join(str(getattr(e, "problem", None) or e).split())  # YAML's own text spans lines
            raise TransMLAError(f"-S {kv!r}: the value is not YAML ({problem}).",
                                f"write a YAML value, e.g. -S {k}=5, -S '{k}=[0.125, 0.25]' or quote a string: "
                                f"-S '{k}=\"...\"'.") from e
    return overrides


def profile_of(args) -> Profile:
    return load_profile(args.params, overrides_of(args))


def check_profile_device(profile: Profile) -> None:
    """The params' device is one this machine has, checked before a flow starts (calibration and conversion
    run on the CPU whatever it says: a missing GPU would otherwise fail only at the first evaluation)."""
    from transmla.devices import check_device

    check_device(profile.device, "params device", "set device: cpu in the params or pass -S device=cpu")


def check_variant(profile: Profile, model: str | None = None, method: str | None = None, budget: float | None = None) -> None:
    """--model/--method/--budget against the validated profile, before a flow run starts (a run takes
    10-15 s to start and would report the same mistake under Prefect's traceback)."""
    if model is not None:
        profile.model(model)  # unknown name: one line naming the models there are
    if method == "original" and budget is not None:  # it would be ignored, yet name the run's folders
        raise TransMLAError(f"--method original is the unconverted model: --budget {budget:g} means nothing for it.",
                            "drop --budget (or name a converted --method).")
    if method not in (None, "original"):
        profile.methods.row(method)  # unknown row: one line naming the rows
        if budget is None:
            raise TransMLAError(f"--method {method} names a converted model: it needs its --budget.",
                                "pass --budget, e.g. --budget 0.125.")
    if budget is not None:
        try:
            check_budget(budget)
        except ValueError as e:
            raise TransMLAError(f"--budget: {e}.", "pass a fraction in (0, 1], e.g. --budget 0.125.") from None


def check_new_outputs(args, kinds: dict[str, str]) -> None:
    """An explicit output option (e.g. --out) must name nothing there yet: the flows replace their
    output atomically, which would delete what a user keeps there. Checked before the flow run, so a
    refusal costs nothing. kinds: option name -> "new_dir" | "new_file" (io.paths.check_output)."""
    from transmla.io.paths import check_output

    for name, kind in kinds.items():
        if getattr(args, name, None) is not None:  # "" too: refused as empty, not read as "not given"
            check_output(getattr(args, name), kind, "--" + name.replace("_", "-"))


def check_inputs(kwargs: dict) -> None:
    """Input options a user named (--stats-file, --checkpoint) must be there: refused before the flow run
    starts, with the option in the message (inside the run they fail after Prefect's traceback)."""
    from pathlib import Path

    if "stats_file" in kwargs and not Path(kwargs["stats_file"]).is_file():
        raise TransMLAError(f"--stats-file {kwargs['stats_file']} is not a file.",
                            "point it at a calibration statistics file (python -m flows.calibrate writes one), "
                            "or leave it out to compute the statistics (cached).")
    if "checkpoint" in kwargs and not (Path(kwargs["checkpoint"]) / "config.json").is_file():
        raise TransMLAError(f"--checkpoint {kwargs['checkpoint']} is not a model directory (no config.json).",
                            "point it at a converted (or fine-tuned) checkpoint directory, or leave it out for "
                            "the pipeline's own.")


def check_tracking(experiment: str | None = None) -> None:
    """The MLflow store answers (tasks.tracking.check_store) and the experiment, where it exists, is not deleted,
    before a flow that logs to it starts its work."""
    from tasks import tracking

    tracking.check_store()
    if experiment is not None:
        tracking.check_experiment(experiment)


def run(main) -> None:
    """Run `main()`; a TransMLAError becomes one line with its fix and exit code 2.

    SIGINT/SIGTERM/SIGHUP (Ctrl-C, `kill`, a closed terminal) stop the run at once: the first one
    raises `Interrupted` in the running task, whose atomic writes drop their temporary files, Prefect
    records the task and flow runs as Crashed, and the process ends with one line naming what to
    rerun and exit code 128 + the signal (130, 143, 129). A second signal while that winds down
    ends the process immediately. The cached tasks that finished make the rerun resume there.
    """
    interrupts = _Interrupts()
    previous = interrupts.install()
    _quiet_signal_tracebacks()
    interrupted = False
    try:
        _own_group_for_temporary_server(interrupts)
        main()
        interrupted = bool(interrupts.received)  # a signal Prefect absorbed after the flow's end
    except TransMLAError as e:
        if not interrupts.received:
            print(f"transmla: error: {e}", file=sys.stderr)
            sys.exit(2)
        interrupted = True
    except BaseException as e:  # noqa: BLE001  (an interrupt may surface as whatever it broke)
        interrupted = bool(interrupts.received) or _signal_of(e) is not None
        if not interrupted:
            raise
        if not interrupts.received:
            interrupts.received.append(_signal_of(e))
    finally:
        if not interrupted:
            _Interrupts.restore(previous)
    if interrupted:
        # The handler stays installed: a second signal during interpreter shutdown (Prefect stops
        # its temporary server at exit) then ends the process at once, without a traceback.
        interrupts.exit()


_INTERRUPT_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread by run()'s signal handler. A KeyboardInterrupt, i.e. a
    BaseException: `except Exception` in library code lets it through, and Prefect's task and
    flow engines mark their runs Crashed and re-raise it (checked for Prefect 3.8)."""

    def __init__(self, signum: int):
        import signal

        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# the loggers Prefect's engines report a run's exceptions on (prefect.flow_runs / task_runs: the run loggers)
_PREFECT_RUN_LOGGERS = ("prefect", "prefect.engine", "prefect.flow_runs", "prefect.task_runs")


class _SignalTracebackFilter:
    """Keeps a log record but drops its traceback when the exception stands for a signal (`_signal_of`) or is a
    TransMLAError (bad input, which run() prints as one line with its fix).

    A SIGTERM that lands while Prefect starts a task run crashes Prefect's own crash handling (ValueError
    "Task run is not set", the TerminationSignal as its context), and the flow engine logs that with
    `logger.exception`: a page of Prefect's internals above run()'s one line. The engines log an input error
    raised inside a task or flow the same way. The line stays, the traceback goes; any other exception (a bug)
    keeps its traceback."""

    def filter(self, record) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and (isinstance(exc, TransMLAError) or _signal_of(exc) is not None):
            record.exc_info = record.exc_text = None
        return True


def _quiet_signal_tracebacks() -> None:
    """`_SignalTracebackFilter` on Prefect's run loggers (once per process; filters on a logger see its own
    records before any handler does, whatever handlers Prefect's logging setup attaches)."""
    import logging

    for name in _PREFECT_RUN_LOGGERS:
        log = logging.getLogger(name)
        if not any(isinstance(f, _SignalTracebackFilter) for f in log.filters):
            log.addFilter(_SignalTracebackFilter())


def _signal_of(exc: BaseException) -> int | None:
    """The signal an exception stands for: Interrupted, KeyboardInterrupt (SIGINT) or Prefect's
    TerminationSignal (its own SIGTERM handler, installed for the length of a flow run), or any
    exception raised while one of those was being handled (its __cause__ / __context__ chain): a
    SIGTERM that lands while Prefect is still starting a task run crashes Prefect's own crash handling
    with ValueError("Task run is not set"), whose context is the TerminationSignal."""
    import signal

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, Interrupted):
            return exc.signum
        if isinstance(exc, KeyboardInterrupt):
            return int(signal.SIGINT)
        sig = getattr(exc, "signal", None)
        if type(exc).__name__ == "TerminationSignal" and isinstance(sig, int):
            return sig
        exc = exc.__cause__ or exc.__context__
    return None


class _Interrupts:
    """run()'s SIGINT/SIGTERM/SIGHUP handling.

    Prefect 3.8 swaps its own SIGTERM handler in while a flow runs (utilities.engine.capture_sigterm):
    it raises TerminationSignal, the engines mark the task and flow runs Crashed, and on the way out
    it restores the previous handler (this one) and sends the signal again, so `handler` raises
    `Interrupted(SIGTERM)` from there. SIGINT reaches `handler` directly.
    """

    def __init__(self):
        self.received: list[int] = []
        self.flow: str | None = None
        self.reported = False
        self.children: list = []  # processes started in their own process group (stopped on a forced exit)

    def install(self) -> dict:
        import signal

        previous = {}
        for name in _INTERRUPT_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is None:
                continue
            try:
                old = signal.getsignal(sig)
                if old is signal.SIG_IGN:  # e.g. nohup, or a background job: keep it ignored
                    continue
                signal.signal(sig, self.handler)
            except ValueError:  # not the main thread
                return previous
            previous[sig] = old
        return previous

    @staticmethod
    def restore(previous: dict) -> None:
        import signal

        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)

    def handler(self, signum, frame) -> None:
        self.received.append(signum)
        if len(self.received) == 1:
            self.flow = self._running_flow()
            raise Interrupted(signum)
        self.exit(forced=True)

    @staticmethod
    def _running_flow() -> str | None:
        ctx = sys.modules.get("prefect.context")
        try:
            run_ctx = ctx.FlowRunContext.get() if ctx else None
            return run_ctx.flow.name if run_ctx and run_ctx.flow else None
        except Exception:  # noqa: BLE001
            return None

    @staticmethod
    def _command_flow() -> str:
        """The flow module run (`python -m flows.convert` -> convert), for a signal outside a flow run."""
        from pathlib import Path

        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        return spec.name.rsplit(".", 1)[-1] if spec else Path(sys.argv[0]).stem

    def exit(self, forced: bool = False) -> None:
        """One line naming what to rerun, then exit 128 + the first signal (no traceback)."""
        import os
        import signal

        sig = self.received[0]
        if not self.reported:
            self.reported = True
            try:  # (after a SIGHUP the terminal may be gone)
                print(f"transmla: interrupted ({signal.Signals(sig).name}) during flow "
                      f"{self.flow or self._command_flow()}: nothing partial was kept; rerun the same command "
                      "(or make repro) to resume from the last finished step.", file=sys.stderr, flush=True)
            except OSError:
                pass
        if not forced:
            sys.exit(128 + sig)
        # A second signal: skip the rest of the clean-up (Prefect's reports, atexit), stop what we started.
        for p in self.children:
            try:
                p.kill()
            except Exception:  # noqa: BLE001
                pass
        try:
            sys.stdout.flush()
        except Exception:  # noqa: BLE001
            pass
        os._exit(128 + sig)


def _own_group_for_temporary_server(interrupts: _Interrupts) -> None:
    """Start Prefect's temporary server (no PREFECT_API_URL) in its own process group.

    Prefect starts it as a plain child, so a Ctrl-C in the terminal reaches it too: it shuts down
    while this process still reports the interrupted task and flow runs to it, and every report
    then retries a ConnectError for about a minute (the issue's "ConnectError once the server was
    gone"). In its own group only this process's exit stops it (Prefect's atexit hook, or
    `interrupts.exit` on a forced exit).
    """
    import os
    import subprocess
    import types

    if os.name != "posix":
        return
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return
    from prefect.server.api import server

    class _Subprocess(types.ModuleType):
        """`subprocess` as prefect.server.api.server sees it: Popen in a new process group."""

        def __getattr__(self, name):
            return getattr(subprocess, name)

        @staticmethod
        def Popen(*args, **kwargs):  # noqa: N802
            kwargs.setdefault("process_group", 0)
            p = subprocess.Popen(*args, **kwargs)
            interrupts.children.append(p)
            return p

    server.subprocess = _Subprocess("subprocess")


def entry(flow, doc: str, variant: bool | str = False, model: bool = True, new_outputs: dict[str, str] | None = None,
          tracked: bool | str = True, **options: str) -> None:
    """The command line of one flow module: `python -m flows.<name>`.

    --params/-S always; --model (and --method/--budget for a converted `variant`); each option
    `name="help"` becomes --name (a flag if the help starts with "flag:"), passed to the flow as
    name=value when given. The flow is called as flow(profile, model, method, budget, **options).
    new_outputs: {option: "new_dir" | "new_file"}: output options refused when given and already holding something.
    tracked: the flow logs to MLflow, whose store must answer (an option's name: unless that option is given,
    e.g. "out" for a one-off run that logs nothing).
    The profile, --model/--method/--budget, those outputs and the store are checked before the flow run starts.
    """
    ap = variant_parser(doc, original=variant == "or-original") if variant else parser(doc)
    if model and not variant:
        ap.add_argument("--model", required=True, help="a model name from the params' models:")
    for name, help_ in options.items():
        flag = "--" + name.replace("_", "-")
        if help_.startswith("flag:"):
            ap.add_argument(flag, dest=name, action="store_true", help=help_[5:].strip())
        else:
            ap.add_argument(flag, dest=name, help=help_)

    def main():
        args = ap.parse_args()
        kwargs = {k: getattr(args, k) for k in options if getattr(args, k) not in (None, False)}
        pos = [args.model, args.method, args.budget] if variant else ([args.model] if model else [])
        profile = profile_of(args)
        check_profile_device(profile)
        check_variant(profile, *pos)
        check_new_outputs(args, new_outputs or {})
        check_inputs(kwargs)
        if tracked is True or (isinstance(tracked, str) and tracked not in kwargs):
            check_tracking(profile.mlflow.experiment)
        result = flow(profile, *pos, **kwargs)
        if isinstance(result, str):
            print(result)

    run(main)

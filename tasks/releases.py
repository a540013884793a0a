"""Nightly inputs: the releases a watch entry points at today (metadata only, never weights)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from transmla.io.releases import Release, discover, resolve


@task(name="watch_releases", cache_policy=NO_CACHE)  # the point is to ask again every night
def watch_releases(entry: str | dict, max_params: float | None) -> list[dict]:
    """A source string -> its one current release; {"hub": query} -> one release per repository found.
    A source that cannot be resolved (index or hub unreachable, bad name) comes back refused, with why."""
    if isinstance(entry, dict):
        return [r.to_dict() for r in discover(entry["hub"], max_params)]
    try:
        return [resolve(entry, max_params=max_params).to_dict()]
    except Exception as e:  # noqa: BLE001  (one source's trouble never stops the night)
        return [Release(entry, entry, "?", refused=f"{e.__class__.__name__}: {e}").to_dict()]

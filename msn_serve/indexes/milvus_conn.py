"""Where a Milvus index is: the connection, the collection names, and the aliases that swap a whole copy in.

``pymilvus`` (``pip install 'msn[milvus]'``) is imported when a Milvus index is first used. ``--milvus-uri`` is a
Milvus Lite file (``PATH.db``: the engine runs inside msn-serve; default ``<data-dir>/milvus.db``) or a server URL
(``http://host:19530``); the same client code talks to both.

An index ``<name>`` is found under ``msn_<name>`` (``_`` ``.`` ``-`` in the name written ``_u`` ``_d`` ``_h``):
a collection of that name (what ``POST /index`` creates) or an alias pointing at one ``msn_<name>__v<time><hex>``
(what the offline copies of :mod:`msn_serve.index_tools.milvus_copy` make, so that a copy is swapped in by moving
the alias: the name always resolves to one whole collection). A swap killed half-way is finished the next time the
indexes are listed (:meth:`MilvusConnection.finish_swaps`), so recovery needs no command. What one collection holds
is :mod:`msn_serve.indexes.milvus`'s.
"""
from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

from msn_core.optional import require
from msn_serve.errors import ApiError

__all__ = ["BACKUP_PREFIX", "GEN", "PREFIX", "MilvusConnection", "MilvusUnavailable", "collection_name",
           "index_name", "milvus_errors", "physical_name", "physical_owner"]

log = logging.getLogger("msn_serve.indexes")
PREFIX = "msn_"
_ESCAPES = {"_": "_u", ".": "_d", "-": "_h"}
GEN = "__v"  # physical collections behind an alias: msn_<name>__v<time><hex> (no escaped name contains "__v")
BACKUP_PREFIX = "msnbak_"  # collections kept by msn-index migrate (not indexes)


class MilvusUnavailable(ValueError):
    """Milvus cannot be reached or opened; the message says why and what to do (msn-serve exits with it)."""


def collection_name(name: str) -> str:
    return PREFIX + "".join(_ESCAPES.get(ch, ch) for ch in name)


def index_name(collection: str) -> str | None:
    """The index name of one of our collections (None for anything else in the database)."""
    if not collection.startswith(PREFIX):
        return None
    out, rest = [], iter(collection[len(PREFIX):])
    back = {v[1]: k for k, v in _ESCAPES.items()}
    for ch in rest:
        out.append(back.get(next(rest, ""), "?") if ch == "_" else ch)
    return "".join(out)


def physical_name(name: str) -> str:
    """A new collection for index ``name``, to be swapped in under :func:`collection_name` by an alias."""
    return f"{collection_name(name)}{GEN}{time.strftime('%Y%m%d%H%M%S')}{secrets.token_hex(3)}"


def physical_owner(collection: str) -> str | None:
    """The index whose :func:`physical_name` ``collection`` is (None for anything else)."""
    base, sep, _ = collection.rpartition(GEN)
    name = index_name(base) if sep else None
    return name if name is not None and collection_name(name) == base else None


@contextlib.contextmanager
def milvus_errors(what: str) -> Iterator[None]:
    """A failed Milvus call becomes a 503 naming it (the write did not happen or is safe to retry: adds are upserts)."""
    from pymilvus.exceptions import MilvusException

    try:
        yield
    except MilvusException as e:
        log.error("%s: Milvus failed (%s)", what, e)
        raise ApiError(503, f"{what}: Milvus failed ({getattr(e, 'message', e)}); retry later") from e


class MilvusConnection:
    """One ``MilvusClient`` for ``uri``. Milvus Lite opens its file in one process at a time: a second gets a clear
    error instead of pymilvus' "Open local milvus failed"."""

    def __init__(self, uri: str):
        pymilvus = require("pymilvus", "a Milvus index (--milvus-uri, backend 'milvus')")
        self.lite = not uri.startswith(("http://", "https://", "tcp://", "grpc://", "unix:"))
        if self.lite:
            require("milvus_lite", "Milvus Lite (--milvus-uri PATH.db)")
            path = Path(uri).expanduser().absolute()
            if path.suffix != ".db":
                raise MilvusUnavailable(f"--milvus-uri {uri}: a Milvus Lite database is a path ending in .db "
                                        "(or give a server URL, http://host:19530)")
            path.parent.mkdir(parents=True, exist_ok=True)
            uri = str(path)
        self.uri = uri
        try:
            self.client = pymilvus.MilvusClient(uri)
        except pymilvus.exceptions.MilvusException as e:
            raise MilvusUnavailable(self._why(e)) from None

    def _why(self, e: Exception) -> str:
        if self.lite and _locked(Path(self.uri) / "LOCK"):
            return (f"Milvus Lite database {self.uri} is open in another process, and Milvus Lite allows one at a "
                    "time: stop that process, give this server another --milvus-uri, or run a Milvus server and "
                    "give its URL")
        return f"cannot open Milvus at {self.uri}: {getattr(e, 'message', e)}"

    def describe(self) -> str:
        return f"Milvus Lite {self.uri}" if self.lite else "Milvus server"

    def aliases(self) -> dict[str, str]:
        """``{alias: collection}`` of our aliases (``msn_<name>``)."""
        names = self.client.list_aliases().get("aliases", [])
        return {a: self.client.describe_alias(a)["collection_name"] for a in names if a.startswith(PREFIX)}

    def resolve(self, name: str) -> str | None:
        """The collection index ``name`` is stored in: its alias' target, the collection of its name, or None."""
        handle = collection_name(name)
        target = self.aliases().get(handle)
        if target is not None:
            return target
        return handle if handle in self.client.list_collections() else None

    def collections(self) -> dict[str, str]:
        """``{index name: collection name or alias}`` of the indexes stored here (interrupted swaps finished)."""
        self.finish_swaps()
        found = {}
        for c in [*self.client.list_collections(), *self.aliases()]:
            name = index_name(c)
            if name is not None and collection_name(name) == c:
                found[name] = c
        return found

    def orphans(self, name: str) -> list[str]:
        """Collections of index ``name`` its name does not resolve to: an interrupted copy, or the old collection
        of a finished swap not yet dropped. Only the offline commands drop them (:meth:`drop_orphans`)."""
        current = self.resolve(name)
        return [c for c in self.client.list_collections() if physical_owner(c) == name and c != current]

    def drop_orphans(self, name: str) -> None:
        for c in self.orphans(name):
            log.warning("index %s: dropping collection %s (left by an interrupted copy or swap)", name, c)
            self.client.drop_collection(c)

    def finish_swaps(self) -> None:
        """Finish a swap killed between renaming a collection away from an index's name and pointing the name's
        alias at its replacement: the replacement carries the record (``msn.swap``, written before the rename)."""
        from pymilvus.exceptions import MilvusException

        aliased = set(self.aliases().values())
        present = set(self.client.list_collections())
        for c in sorted(present, reverse=True):  # the newest copy first
            name = physical_owner(c)
            if name is None or c in aliased or self.resolve(name) is not None:
                continue
            record = self.client.describe_collection(c).get("properties", {}).get("msn.swap")
            old = json.loads(record).get("old") if record else None
            if old not in present:  # no record, or the rename never happened (the index was dropped since)
                continue
            log.warning("index %s: finishing an interrupted swap (its name now points at %s)", name, c)
            try:
                self.client.create_alias(c, collection_name(name))
                if json.loads(record).get("drop"):
                    self.client.drop_collection(old)
            except MilvusException as e:  # another process (a shared server) finished it first
                log.warning("index %s: could not finish the swap (%s)", name, getattr(e, "message", e))

    def close(self) -> None:
        """Close the client; Milvus Lite's engine (in this process) is stopped too, releasing its file."""
        with contextlib.suppress(Exception):
            self.client.close()
        if self.lite:
            from milvus_lite import server_manager_instance

            server_manager_instance.release_server(self.uri)


def _locked(lock_file: Path) -> bool:
    import fcntl
    import os

    try:
        fd = os.open(lock_file, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)

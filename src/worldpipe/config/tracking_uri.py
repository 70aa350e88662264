"""The syntax of an MLflow tracking URI, checked before any process starts (no MLflow import, no connection).

Accepted: ``sqlite:///PATH`` (``sqlite:////abs``), a database URL (``postgresql://USER:PASSWORD@HOST:PORT/DB``,
also ``postgresql+psycopg2``, ``mysql``, ``mssql``), ``http(s)://HOST[:PORT][/PATH]``, ``file:///PATH`` or a plain
path (MLflow's file store). Whether the server answers is the tracking room's concern (records are spooled).
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

DATABASE_SCHEMES = ("postgresql", "mysql", "mssql")  # each also with a driver: postgresql+psycopg2://
WEB_SCHEMES = ("http", "https")
KNOWN_SCHEMES = ("sqlite", *DATABASE_SCHEMES, *WEB_SCHEMES, "file")
EXPECTED = ("expected sqlite:///PATH, postgresql://USER:PASSWORD@HOST:PORT/DB, http(s)://HOST[:PORT], "
            "file:///PATH or a plain path")
# RFC 3986 characters (unreserved, reserved, percent); a plain path gets a narrower set: no shell text in it.
_URI_CHARS = re.compile(r"^[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]+$")
_PATH_CHARS = re.compile(r"^[A-Za-z0-9\-._~/+@=,:%]+$")
_SCHEME = re.compile(r"^([a-z][a-z0-9.-]*)(\+[a-z0-9_]+)?$")
_HOST = re.compile(r"^([A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*\.?|\[[0-9A-Fa-f:.]+\])$")


def tracking_uri_problem(uri: str | None) -> str | None:
    """What is wrong with ``uri`` as a tracking URI (None: empty, or well-formed)."""
    if uri is None or uri == "":
        return None
    if not isinstance(uri, str):
        return f"must be a URI string, got {uri!r}"
    if any(c.isspace() or not c.isprintable() for c in uri):
        return f"{uri!r} contains whitespace or control characters; {EXPECTED}"
    if "${" in uri:
        return f"{uri!r} contains an interpolation '${{'; {EXPECTED}"
    if "://" not in uri:
        return _path_problem(uri)
    if not _URI_CHARS.match(uri):
        bad = next(c for c in uri if not _URI_CHARS.match(c))
        return f"{uri!r} contains {bad!r}, which is not a URI character; {EXPECTED}"
    scheme = uri.split("://", 1)[0]
    match = _SCHEME.match(scheme)
    base = match.group(1) if match else scheme
    if match is None or base not in KNOWN_SCHEMES or (match.group(2) and base not in DATABASE_SCHEMES):
        return f"{uri!r} has an unknown scheme {scheme!r}; {EXPECTED}"
    return _shape_problem(uri, base)


def _path_problem(uri: str) -> str | None:
    head = re.split(r"[:/]", uri, maxsplit=1)[0]
    if head.lower() in KNOWN_SCHEMES:
        return f"{uri!r} looks like a {head} URI without '://'; {EXPECTED}"
    if not _PATH_CHARS.match(uri):
        bad = next(c for c in uri if not _PATH_CHARS.match(c))
        return f"{uri!r} is a plain path with {bad!r} in it (shell text?); {EXPECTED}"
    return None


def _shape_problem(uri: str, scheme: str) -> str | None:
    if scheme == "sqlite":
        if not uri.startswith("sqlite:///") or len(uri) == len("sqlite:///"):
            return f"{uri!r}: a SQLite URI is sqlite:///relative/path.db or sqlite:////absolute/path.db"
        return None
    if scheme == "file":
        parts = urlsplit(uri)
        if parts.netloc not in ("", "localhost") or not parts.path:
            return f"{uri!r}: a file URI is file:///absolute/path"
        return None
    try:
        parts = urlsplit(uri)
        port = parts.port
    except ValueError as err:
        return f"{uri!r}: {err}; {EXPECTED}"
    host = parts.netloc.rsplit("@", 1)[-1]
    host = host.split("]", 1)[0] + "]" if host.startswith("[") else host.split(":", 1)[0]
    if not host:
        return f"{uri!r} names no host; {EXPECTED}"
    if not _HOST.match(host):
        return f"{uri!r}: {host!r} is not a host name or address; {EXPECTED}"
    if port == 0:
        return f"{uri!r}: port 0 is not a TCP port"
    if scheme in DATABASE_SCHEMES and parts.path.strip("/") == "":
        return f"{uri!r}: names no database ({scheme}://USER:PASSWORD@HOST:PORT/DB)"
    return None

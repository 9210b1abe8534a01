"""Where lockstep's files are: its packaged data, and the user's cache.

Package data is found through the import system (``importlib.resources``), so the same code finds
it in a source checkout (editable install) and in an installed wheel. Caches (node cases,
converted models) live in ``$LOCKSTEP_CACHE_DIR`` or the user cache directory
(``platformdirs.user_cache_dir("lockstep")``), never in the working directory.
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

__all__ = ["package_path", "cache_dir", "CacheDirError", "atomic_write"]


class CacheDirError(RuntimeError):
    """The cache directory cannot be created or written."""


def package_path(package: str, *parts: str) -> Path:
    """A file or folder inside one of lockstep's packages, e.g. ``package_path("lockstep.contracts",
    "sync_allowlist.toml")``."""
    return Path(str(files(package))).joinpath(*parts)


def cache_dir(*parts: str) -> Path:
    """``$LOCKSTEP_CACHE_DIR`` (or the user cache directory)/``parts``, created and checked writable."""
    given = os.environ.get("LOCKSTEP_CACHE_DIR")
    if given:
        base, where = Path(given), "LOCKSTEP_CACHE_DIR"
    else:
        import platformdirs

        base, where = Path(platformdirs.user_cache_dir("lockstep")), "the user cache directory"
    path = base.joinpath(*parts)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CacheDirError(f"{where} {base}: cannot create {path}: {exc.strerror}; "
                            "set LOCKSTEP_CACHE_DIR to a writable folder") from None
    if not os.access(path, os.W_OK):
        raise CacheDirError(f"{where} {base}: {path} is not writable; set LOCKSTEP_CACHE_DIR to a writable folder")
    return path


def atomic_write(path: str | os.PathLike, data) -> Path:
    """Write ``data`` (bytes, text, or a function writing into a binary file object) to ``path``
    through a temporary file in the same folder and ``os.replace``: a crash leaves the old file or
    the new one, never half of one. Mode 0644."""
    import tempfile

    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path

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

__all__ = ["package_path", "cache_dir", "CacheDirError"]


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

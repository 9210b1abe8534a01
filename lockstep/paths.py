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

from lockstep.errors import LockstepError

__all__ = ["package_path", "cache_dir", "CacheDirError", "atomic_write", "clean_stale_temps"]


class CacheDirError(LockstepError, RuntimeError):
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


TMP_SUFFIX = ".lockstep-tmp"  # ignored by git (.gitignore); stale ones are removed by the next write
STALE_AGE_S = 24 * 3600


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # no /proc: read it the only other way (briefly set, then restored)
    os.umask(mask)
    return mask


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def clean_stale_temps(folder: str | os.PathLike) -> list[Path]:
    """Remove the temporary files of ``atomic_write`` calls that died in ``folder``: their writer's
    process is gone (the pid is in the name; a folder is assumed written from one machine at a
    time), or they are older than a day. Returns what it removed."""
    import time

    removed = []
    for p in Path(folder).glob(f".*{TMP_SUFFIX}"):
        try:
            pid = int(p.name[: -len(TMP_SUFFIX)].rsplit(".", 2)[-2])
        except (ValueError, IndexError):
            pid = None
        try:
            old = time.time() - p.stat().st_mtime > STALE_AGE_S
        except FileNotFoundError:
            continue
        if old or pid is None or (pid != os.getpid() and not _pid_alive(pid)):
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def atomic_write(path: str | os.PathLike, data) -> Path:
    """Write ``data`` (bytes, text, or a function writing into a binary file object) to ``path``
    through a temporary file in the same folder and ``os.replace``: a crash leaves the old file or
    the new one, never half of one. The temporary file is ``.<name>.<pid>.<random>.lockstep-tmp``
    (git ignores the suffix); one left by a writer that was killed is removed by the next write into
    that folder. A rewritten file keeps its mode; a new one gets 0644 under the umask."""
    import tempfile

    path = Path(path)
    clean_stale_temps(path.parent)
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o644 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=TMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path

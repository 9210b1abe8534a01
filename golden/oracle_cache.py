"""The oracle's results on disk, by content: what a run of ``oracle_run`` computed is not computed again.

The oracle (onnx's reference evaluator, then the float64 cross-check on the reference runtime) is
a pure function of its inputs: the oracle's model, the prompt, the recorded prefix length, the
cross-check's model, the model card; and of the code and libraries that compute it. A result is
stored under a digest of all of these (``key``):

- the caller's description of the inputs (model sha256s, prompt, options: ``oracle_run``'s ``key``);
- the versions of onnx, numpy, ml_dtypes and Python, and the machine (its CPU architecture);
- a digest of the source that computes it (``source_digest``: the golden package, the reference
  runtime and its kernels, the decoder I/O: a change to the oracle, the runtime or a kernel is
  another key; one to the CLI or the plugin is not).

So a result is reused only where recomputing it would give the same numbers; any change makes a
new key (old entries are never trusted for another). Entries live in ``cache_dir("oracle")``
(``$LOCKSTEP_CACHE_DIR``), one ``.npz`` each, written atomically; an unreadable one is recomputed.
``LOCKSTEP_ORACLE_CACHE=0`` turns the cache off for a process (read once, at first use).
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

__all__ = ["source_digest", "environment", "key", "cached_run", "enabled"]

# What computes an oracle run: the golden package (oracle, anchors, models' generator), the reference
# runtime and its kernels (the float64 cross-check) and the decoder I/O (the feeds). A change
# elsewhere in lockstep (the CLI, the plugin, the report) leaves the oracle's numbers alone.
_PACKAGES = ("lockstep.reference_runtime", "lockstep.kernels", "lockstep.golden")
_MODULES = ("lockstep.decoder_io",)


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 over the source of what computes the oracle (file names and contents, sorted)."""
    import importlib.util

    files = []
    for name in _PACKAGES:
        root = Path(importlib.util.find_spec(name).origin).resolve().parent
        files += [(f"{name}/{p.relative_to(root)}", p) for p in root.rglob("*.py")]
    for name in _MODULES:
        files.append((name, Path(importlib.util.find_spec(name).origin)))
    h = hashlib.sha256()
    for label, path in sorted(files):
        h.update(label.encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def _version(dist: str) -> str:
    try:
        mod = __import__(dist)
        return str(getattr(mod, "__version__", "?"))
    except ImportError:
        return "absent"


@functools.lru_cache(maxsize=1)
def environment() -> dict[str, str]:
    """What besides the inputs decides the oracle's numbers."""
    return {"onnx": _version("onnx"), "numpy": np.__version__, "ml_dtypes": _version("ml_dtypes"),
            "python": platform.python_version(), "machine": platform.machine(), "byteorder": sys.byteorder,
            "lockstep_source": source_digest()}


def key(inputs: Any) -> str:
    """The cache key of an oracle run: its inputs (JSON-able) and the environment."""
    text = json.dumps({"inputs": inputs, "environment": environment()}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def enabled() -> bool:
    return os.environ.get("LOCKSTEP_ORACLE_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def _path(digest: str) -> Path:
    from lockstep.paths import cache_dir

    return cache_dir("oracle") / f"{digest}.npz"


def _read(path: Path):
    try:
        with np.load(path, allow_pickle=False) as z:
            prefix = [int(t) for t in z["prefix"]]
            logits = np.array(z["logits"])
            cross = np.array(z["cross"]) if bool(z["has_cross"]) else None
        return prefix, logits, cross
    except Exception:  # noqa: BLE001 - a corrupt or foreign entry is recomputed, never trusted
        return None


def _write(path: Path, run) -> None:
    from lockstep.paths import atomic_write

    prefix, logits, cross = run
    buf = io.BytesIO()
    np.savez(buf, prefix=np.asarray(prefix, np.int64), logits=np.asarray(logits),
             cross=np.asarray(cross if cross is not None else np.zeros(0)), has_cross=np.asarray(cross is not None))
    try:
        atomic_write(path, buf.getvalue())
    except OSError:
        pass  # a cache that cannot be written costs time, never a result


def cached_run(inputs: Any, compute: Callable[[], tuple], progress: Callable[[str], None] | None = None,
               name: str = "") -> tuple:
    """``compute()`` (an ``oracle_run`` result: prefix, logits, cross-check logits or None), or the
    result stored for the same ``inputs`` and environment."""
    if not enabled():
        return compute()
    path = _path(key(inputs))
    if path.is_file():
        run = _read(path)
        if run is not None:
            if progress is not None:
                progress(f"{name}: the oracle's results for this model, prompt and code, from the cache ({path.name[:12]}…)")
            return run
    run = compute()
    _write(path, run)
    return run

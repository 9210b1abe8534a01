"""Runtime configuration: an object, read from the environment once, at construction.

Never a process-global frozen at first use: a test that wants deferral off builds a runtime with
``RuntimeConfig(defer_eager_sync=False)``; a process that wants the environment's choice calls
``RuntimeConfig.from_env()`` (which ``Runtime`` does when given no config).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Mapping

__all__ = ["RuntimeConfig", "parse_bool", "parse_bytes", "SYNC_DEBUG_MODES"]

SYNC_DEBUG_MODES = ("off", "warn", "error")

_TRUE = {"1", "true", "on", "yes"}
_FALSE = {"0", "false", "off", "no"}


def parse_bool(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name}={value!r}: expected one of {sorted(_TRUE | _FALSE)}")


@dataclass(frozen=True)
class RuntimeConfig:
    """Settings of one runtime.

    defer_eager_sync: ``Runtime.synchronize()`` is a no-op (default). Kernel-to-kernel order on
        the runtime's in-order compute stream needs no host synchronisation; callers that need
        completed work use the guarantees named for it (``download``, ``drain_for_unmap``).
        Environment: ``LOCKSTEP_DEFER_EAGER_SYNC=0|false|off|no`` restores the draining behaviour.
    sync_debug: ``off`` (default) | ``warn`` | ``error``. When not ``off`` the runtime records every
        synchronising or host-reading primitive it executes (``synchronize``, the forced
        synchronise, ``drain_for_unmap``, ``download``, ``copy``, ``free``, and a
        ``stream.synchronize()`` on its streams outside the known barriers) into
        ``Runtime.sync_log`` with the call site and ``Runtime.current_node``
        (``reference_runtime.sync_debug``). ``error`` raises ``SyncDebugError`` for a synchronising
        call while a capture is open (``free`` and ``copy`` excepted; a deferred no-op
        ``synchronize()`` included) and for a real stream drain on the deferred eager path outside
        the known barriers; ``warn`` records and issues ``SyncDebugWarning`` for the same cases.
        Off costs one attribute check per primitive.
        Environment: ``LOCKSTEP_SYNC_DEBUG=off|warn|error`` (empty means unset).
    vram_limit: a device budget in bytes for model weights (``None``: no paging, weights stay
        resident). When set, an executor pages its initializers through a ``pager.WeightPager``
        (stable virtual addresses, LRU eviction, mapped granules within the budget); a budget
        smaller than the largest single weight is refused when the session is created.
        Environment: ``LOCKSTEP_VRAM_LIMIT=<bytes>`` with an optional K/M/G suffix (powers of 1024).
    """

    defer_eager_sync: bool = True
    sync_debug: str = "off"
    vram_limit: int | None = None

    def __post_init__(self) -> None:
        if self.vram_limit is not None and (not isinstance(self.vram_limit, int) or self.vram_limit <= 0):
            raise ValueError(f"vram_limit={self.vram_limit!r}: expected a positive number of bytes or None")
        if not isinstance(self.sync_debug, str) or self.sync_debug not in SYNC_DEBUG_MODES:
            raise ValueError(f"sync_debug={self.sync_debug!r}: expected one of {list(SYNC_DEBUG_MODES)}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "RuntimeConfig":
        env = os.environ if environ is None else environ
        cfg = cls()
        raw = env.get("LOCKSTEP_DEFER_EAGER_SYNC")
        if raw is not None and raw.strip() != "":
            cfg = replace(cfg, defer_eager_sync=parse_bool("LOCKSTEP_DEFER_EAGER_SYNC", raw))
        raw = env.get("LOCKSTEP_SYNC_DEBUG")
        if raw is not None and raw.strip() != "":
            mode = raw.strip().lower()
            if mode not in SYNC_DEBUG_MODES:
                raise ValueError(f"LOCKSTEP_SYNC_DEBUG={raw!r}: expected one of {list(SYNC_DEBUG_MODES)}")
            cfg = replace(cfg, sync_debug=mode)
        raw = env.get("LOCKSTEP_VRAM_LIMIT")
        if raw is not None and raw.strip() != "":
            cfg = replace(cfg, vram_limit=parse_bytes("LOCKSTEP_VRAM_LIMIT", raw))
        return cfg


def parse_bytes(name: str, value: str) -> int:
    v = value.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(v[-1:], 1)
    digits = v[:-1] if v[-1:] in "KMG" else v
    try:
        n = int(float(digits) * scale)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a number of bytes, optionally with K, M or G") from None
    if n <= 0:
        raise ValueError(f"{name}={value!r}: must be positive")
    return n

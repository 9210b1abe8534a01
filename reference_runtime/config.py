"""Runtime configuration: an object, read from the environment once, at construction.

Never a process-global frozen at first use: a test that wants deferral off builds a runtime with
``RuntimeConfig(defer_eager_sync=False)``; a process that wants the environment's choice calls
``RuntimeConfig.from_env()`` (which ``Runtime`` does when given no config).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Mapping

__all__ = ["RuntimeConfig", "parse_bool"]

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
    """

    defer_eager_sync: bool = True

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "RuntimeConfig":
        env = os.environ if environ is None else environ
        cfg = cls()
        raw = env.get("LOCKSTEP_DEFER_EAGER_SYNC")
        if raw is not None and raw.strip() != "":
            cfg = replace(cfg, defer_eager_sync=parse_bool("LOCKSTEP_DEFER_EAGER_SYNC", raw))
        return cfg

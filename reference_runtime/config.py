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
    device_memory_limit: the budget in bytes for *all* device memory the runtime's device holds
        (every tensor: weights, feeds, activations, KV caches; pool memory and mapped granules),
        ``None``: the device's own default (``Device.default_memory_limit()``: on the simulated
        device the smaller of 16 GiB and a quarter of the host's memory, since it models a GPU with
        host RAM, less the device memory that maps a model file's pages, ``Device.file_backed_bytes``,
        which the page cache holds; on CuPy the GPU's total memory). An allocation that would pass it is refused
        before anything is allocated with ``errors.MemoryAllocation`` naming the node, the value,
        the size, the budget and the bytes in use. Distinct from ``vram_limit``, which only bounds
        the weight pager's resident weights and must fit within it.
        Environment: ``LOCKSTEP_DEVICE_MEMORY_LIMIT=<bytes>`` with an optional K/M/G suffix.
    execution_plans: an executor compiles an execution plan per step signature (default on): the
        second run of a signature replays the first run's shape inference, kernels, launch
        arguments and folded host values, with its intermediates in buffers planned once
        (``reference_runtime.plan``); off, every run infers and allocates node by node. Same
        launches, same bytes; a benchmark's baseline and a bisection aid.
        Environment: ``LOCKSTEP_EXECUTION_PLANS=0|false|off|no`` turns it off.
    launch_replay: a plan records each static node's launch on its first planned run and relaunches
        the record on later runs, without the kernel's host code, while the node gets the very same
        tensors (default on; ``Runtime.launch_recorded``/``relaunch``). On CuPy a record holds the
        RawKernel launches of a body that issued nothing else; on the simulated device it is the
        launch itself. Off: every planned node runs its kernel body. Same launches, same bytes.
        Environment: ``LOCKSTEP_LAUNCH_REPLAY=0|false|off|no`` turns it off.
    max_loop_iterations: the most iterations one ``Loop`` may run (default 1,000,000): a trip count
        above it is refused before the first iteration, a condition-driven loop when it gets there,
        with ``OpError`` naming the node, the count and the budget (a fuzzed trip count of 2**31-1
        would otherwise run for hours). Environment: ``LOCKSTEP_MAX_LOOP_ITERATIONS=<n>``.
    fuse_kernels: an executor fuses groups of nodes into one step and one launch (default on;
        ``reference_runtime.fusion``: x*sigmoid(x)*u, Add then RMSNormalization, the MatMuls of one
        activation by constant weights (float32), side-by-side RotaryEmbedding or TensorScatter
        pairs), with the unfused nodes' bits. Off: one step per node. Same bytes; fewer launches a step.
        Environment: ``LOCKSTEP_FUSE_KERNELS=0|false|off|no`` turns it off.
    """

    defer_eager_sync: bool = True
    sync_debug: str = "off"
    vram_limit: int | None = None
    device_memory_limit: int | None = None
    execution_plans: bool = True
    launch_replay: bool = True
    fuse_kernels: bool = True
    max_loop_iterations: int = 1_000_000

    def __post_init__(self) -> None:
        if not isinstance(self.max_loop_iterations, int) or isinstance(self.max_loop_iterations, bool) \
                or self.max_loop_iterations < 1:
            raise ValueError(f"max_loop_iterations={self.max_loop_iterations!r}: expected a positive integer")
        for name in ("vram_limit", "device_memory_limit"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ValueError(f"{name}={v!r}: expected a positive number of bytes or None")
        if self.vram_limit is not None and self.device_memory_limit is not None \
                and self.vram_limit > self.device_memory_limit:
            raise ValueError(f"vram_limit={self.vram_limit} exceeds device_memory_limit={self.device_memory_limit}: "
                             "the pager's weights live in device memory")
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
        raw = env.get("LOCKSTEP_EXECUTION_PLANS")
        if raw is not None and raw.strip() != "":
            cfg = replace(cfg, execution_plans=parse_bool("LOCKSTEP_EXECUTION_PLANS", raw))
        raw = env.get("LOCKSTEP_LAUNCH_REPLAY")
        if raw is not None and raw.strip() != "":
            cfg = replace(cfg, launch_replay=parse_bool("LOCKSTEP_LAUNCH_REPLAY", raw))
        raw = env.get("LOCKSTEP_FUSE_KERNELS")
        if raw is not None and raw.strip() != "":
            cfg = replace(cfg, fuse_kernels=parse_bool("LOCKSTEP_FUSE_KERNELS", raw))
        raw = env.get("LOCKSTEP_VRAM_LIMIT")
        if raw is not None and raw.strip() != "":
            cfg = replace(cfg, vram_limit=parse_bytes("LOCKSTEP_VRAM_LIMIT", raw))
        raw = env.get("LOCKSTEP_DEVICE_MEMORY_LIMIT")
        if raw is not None and raw.strip() != "":
            cfg = replace(cfg, device_memory_limit=parse_bytes("LOCKSTEP_DEVICE_MEMORY_LIMIT", raw))
        raw = env.get("LOCKSTEP_MAX_LOOP_ITERATIONS")
        if raw is not None and raw.strip() != "":
            try:
                n = int(raw.strip())
            except ValueError:
                raise ValueError(f"LOCKSTEP_MAX_LOOP_ITERATIONS={raw!r}: expected a positive integer") from None
            if n < 1:
                raise ValueError(f"LOCKSTEP_MAX_LOOP_ITERATIONS={raw!r}: expected a positive integer")
            cfg = replace(cfg, max_loop_iterations=n)
        return cfg


def parse_bytes(name: str, value: str) -> int:
    v = value.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(v[-1:], 1)
    digits = v[:-1] if v[-1:] in "KMG" else v
    try:
        n = int(float(digits) * scale)
    except (ValueError, OverflowError):  # not a number; inf
        raise ValueError(f"{name}={value!r}: expected a number of bytes, optionally with K, M or G") from None
    if n <= 0:
        raise ValueError(f"{name}={value!r}: must be positive")
    return n

"""How much host memory this process may use: the bound for host-backed budgets.

Two things hold host memory on lockstep's behalf: the simulated device (its memory is host RAM)
and decode sessions' KV caches (numpy arrays). Their default budgets are a share of what the
process may really allocate, which is the smallest of:

- the host's physical memory (``sysconf``), a quarter of it;
- the cgroup's memory limit (``memory.max`` of cgroup v2, ``memory.limit_in_bytes`` of v1), a
  quarter of it: a container's RAM, which ``sysconf`` does not see;
- the address space left under ``RLIMIT_AS`` (``ulimit -v``) now: the soft limit minus the
  process's current virtual size (``VmSize``), half of it, since a kernel's host temporaries and
  numpy's copies need room beside what the budget admits.

Each figure is read when asked (not cached: a limit can be set after import, as the fuzzer's
forked workers do); ``host_budget()`` returns the smallest share and says which one bounds it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HostBudget", "host_budget", "physical_memory", "cgroup_memory_limit", "address_space_left", "fmt_bytes"]

_UNLIMITED = 1 << 60  # cgroup v1 writes a huge number for "no limit"


def physical_memory() -> int | None:
    """The host's physical memory in bytes, or None where the platform does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def cgroup_memory_limit(root: str | os.PathLike[str] = "/sys/fs/cgroup") -> int | None:
    """This process's cgroup memory limit in bytes (v2, else v1), or None when there is none."""
    base = Path(root)
    candidates = []
    try:  # v2: the process's own cgroup, e.g. "0::/user.slice/..."
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            parts = line.split(":", 2)
            if len(parts) == 3 and parts[0] == "0":
                candidates.append(base / parts[2].lstrip("/") / "memory.max")
    except OSError:
        pass
    candidates += [base / "memory.max", base / "memory" / "memory.limit_in_bytes"]
    for p in candidates:
        try:
            text = p.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            v = int(text)
        except ValueError:
            continue
        return v if 0 < v < _UNLIMITED else None
    return None


def _vm_size() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def address_space_left() -> int | None:
    """Bytes of address space this process may still map under ``RLIMIT_AS``, or None when the
    limit is unlimited (or the platform does not say)."""
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None
    used = _vm_size()
    return max(soft - (used or 0), 0)


@dataclass(frozen=True)
class HostBudget:
    """A budget in bytes and what bounds it (for messages: "a quarter of the host's 23.4 GiB")."""

    nbytes: int
    why: str


def fmt_bytes(n: int) -> str:
    for unit, k in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k:
            return f"{n / (1 << k):.1f} {unit}"
    return f"{n} bytes"


def host_budget(cap: int | None = None) -> HostBudget:
    """The smallest of: a quarter of physical memory, a quarter of the cgroup limit, half the
    address space left under RLIMIT_AS, and ``cap`` (where given); ``cap`` itself when none of
    the others is known."""
    options: list[HostBudget] = []
    if cap is not None:
        options.append(HostBudget(cap, f"the default cap of {fmt_bytes(cap)}"))
    phys = physical_memory()
    if phys:
        options.append(HostBudget(phys // 4, f"a quarter of the host's {fmt_bytes(phys)} of memory"))
    cg = cgroup_memory_limit()
    if cg:
        options.append(HostBudget(cg // 4, f"a quarter of the cgroup's memory limit of {fmt_bytes(cg)}"))
    left = address_space_left()
    if left is not None:
        options.append(HostBudget(left // 2, f"half the {fmt_bytes(left)} of address space left under "
                                              "RLIMIT_AS (ulimit -v)"))
    if not options:
        return HostBudget(16 << 30, "16 GiB (the host does not say how much memory it has)")
    return min(options, key=lambda b: b.nbytes)

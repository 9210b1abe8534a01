"""The seeds' bug on a real GPU: a weight evicted while a queued kernel still reads it.

    python scripts/paging_check.py [--device cupy|sim] [--json FILE]

In a child process per variant (a poisoned CUDA context dies with its process): a pager with a
one-weight budget holds weight A; a 300 ms spin kernel is queued, then a kernel that copies A into
an output; then the pager pages in weight B, which evicts A (barrier, unmap, release) while that
copy is still queued. Variants: ``drain`` (the real pager: ``drain_for_unmap`` before the unmap)
and ``sync-barrier`` (the seeds' mutant: the deferred ``synchronize()``). Recorded per variant:
whether the eviction waited for the queued kernel, what the next synchronising read raised or
returned, and whether the context still works afterwards. The ``drain`` variant must be clean and
read A's bytes; the mutant's outcome is what this GPU and driver do (CUDA leaves it undefined).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
import traceback
from pathlib import Path


SPIN_US = 300_000


def _child(variant: str, device: str, q) -> None:
    import os

    import numpy as np
    from lockstep.contracts.mutants import SyncBarrierPager
    from lockstep.kernels import primitives as P
    from lockstep.reference_runtime import Runtime, RuntimeConfig
    from lockstep.reference_runtime.backends import make_device
    from lockstep.reference_runtime.pager import WeightPager

    rec: dict = {"variant": variant, "device": device}
    try:
        rt = Runtime(make_device(device), RuntimeConfig())
        cls = WeightPager if variant == "drain" else SyncBarrierPager
        if hasattr(rt.device, "_drv"):
            rt.device._drv()  # CUDA: the VMM granularity comes from the driver
        g = rt.device.granularity
        pager = cls(rt, g)  # budget: one weight
        n = 4096
        ta = pager.register("A", np.full(n, 1.0, np.float32))
        pager.register("B", np.full(n, 2.0, np.float32))
        out = rt.empty((n,), np.float32, name="out")
        flag = rt.empty((1,), np.int32, name="flag")
        rt.launch(P.fill, flag, value=0)
        pager.ensure(["A"])
        rt.launch(P.spin, flag, microseconds=1000)  # warm (compile) both kernels first
        rt.launch(P.copy, out, ta)
        rt.drain_for_unmap()
        rt.launch(P.fill, out, value=0.0)
        rt.launch(P.spin, flag, microseconds=SPIN_US)
        rt.launch(P.copy, out, ta)  # the queued reader of A
        t0 = time.perf_counter()
        pager.ensure(["B"])  # evicts A under the queued reader
        rec["evict_seconds"] = round(time.perf_counter() - t0, 4)
        rec["evict_waited_for_queued_kernel"] = rec["evict_seconds"] > SPIN_US / 2e6
        try:
            vals = rt.download(out)
            rec["read"] = "ok"
            rec["out"] = {"min": float(vals.min()), "max": float(vals.max()),
                          "all_A": bool((vals == 1.0).all()), "all_B": bool((vals == 2.0).all())}
        except Exception as exc:  # noqa: BLE001 - the outcome is the observation
            rec["read"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        try:
            rt.empty((16,), np.float32)
            rt.download(rt.upload(np.arange(4, dtype=np.float32)))
            rec["later_call"] = "ok"
        except Exception as exc:  # noqa: BLE001
            rec["later_call"] = f"{type(exc).__name__}"
    except Exception:  # noqa: BLE001
        rec["setup_error"] = traceback.format_exc()[-800:]
    q.put(rec)
    q.close()
    q.join_thread()
    os._exit(0)


def run_variant(variant: str, device: str, timeout: float = 120.0) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(variant, device, q))
    p.start()
    p.join(timeout)
    if p.is_alive():
        p.kill()
        return {"variant": variant, "device": device, "read": f"timeout after {timeout} s"}
    try:
        return q.get(timeout=5)
    except Exception:  # noqa: BLE001
        return {"variant": variant, "device": device, "read": f"child exited {p.exitcode} without a report"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cupy")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    results = [run_variant(v, args.device) for v in ("drain", "sync-barrier")]
    for r in results:
        print(json.dumps(r))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    drain = results[0]
    ok = drain.get("read") == "ok" and drain.get("out", {}).get("all_A") and drain.get("later_call") == "ok"
    print(f"paging check: drain variant {'clean, read A' if ok else 'NOT clean'}; "
          f"sync-barrier variant: read {results[1].get('read')}, later call {results[1].get('later_call')}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

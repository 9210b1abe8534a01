"""What CuPy does with each host-read form inside a stream capture (run on a GPU).

Each form runs on a fresh non-blocking stream while it captures (CuPy's default, relaxed mode):
the table says what the call raised (or that it returned), and whether ``end_capture()`` then
reported the capture invalidated. These are the measured facts behind the static audit's sinks and
the simulated device's capture guard (``docs/capture-guard.md``).

    python scripts/capture_probe.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import sys


def _forms(cp):
    x = cp.arange(8, dtype=cp.float32)
    mask = x > 3
    return {
        "float(x[0])": lambda: float(x[0]),
        "x[0].item()": lambda: x[0].item(),
        "x.__float__() (0-d)": lambda: x.sum().__float__(),
        "bool(x.any())": lambda: bool(x.any()),
        "not x.any()": lambda: not x.any(),
        "print(x)": lambda: print(x, file=open("/dev/null", "w")),
        "f-string of x": lambda: f"{x}",
        "str(x)": lambda: str(x),
        "repr(x)": lambda: repr(x),
        "format(x[0], '.3f')": lambda: format(x[0], ".3f"),
        "math.exp(x[0])": lambda: math.exp(x[0]),
        "max(x) (builtin)": lambda: max(x),
        "sorted(x) (builtin)": lambda: sorted(x),
        "sum(x) (builtin)": lambda: sum(x),
        "x.tolist()": lambda: x.tolist(),
        "x.get()": lambda: x.get(),
        "cupy.asnumpy(x)": lambda: cp.asnumpy(x),
        "x[mask]": lambda: x[mask],
        "x[mask] = 0": lambda: x.__setitem__(mask, 0),
        "cupy.unique(x)": lambda: cp.unique(x),
        "cupy.extract(mask, x)": lambda: cp.extract(mask, x),
        "cupy.nonzero(x)": lambda: cp.nonzero(x),
        "cupy.where(mask) (one arg)": lambda: cp.where(mask),
        "cupy.matmul": lambda: cp.matmul(x.reshape(2, 4), x.reshape(4, 2)),
        "range(int(x[0]))": lambda: list(range(int(x[0]))),
        "x + 1 (control)": lambda: x + 1,
    }


def _runtime_forms(cp):
    rt = cp.cuda.runtime

    def ev_sync(stream):
        e = cp.cuda.Event()
        e.record(stream)
        rt.eventSynchronize(e.ptr)

    return {
        "runtime.streamSynchronize(stream)": lambda s: rt.streamSynchronize(s.ptr),
        "runtime.eventSynchronize(event on it)": ev_sync,
        "stream.done (cudaStreamQuery)": lambda s: s.done,
        "stream.synchronize()": lambda s: s.synchronize(),
        "runtime.deviceSynchronize()": lambda s: rt.deviceSynchronize(),
    }


def probe() -> list[dict]:
    import cupy as cp

    rows = []
    names = list(_forms(cp)) + list(_runtime_forms(cp))
    for name in names:
        s = cp.cuda.Stream(non_blocking=True)
        row = {"form": name}
        with s:
            forms = _forms(cp)  # the arrays exist before the capture
            s.synchronize()
            s.begin_capture()
            try:
                if name in forms:
                    forms[name]()
                else:
                    _runtime_forms(cp)[name](s)
                row["call"] = "returned"
            except Exception as exc:  # noqa: BLE001 - the exception is the observation
                row["call"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            try:
                g = s.end_capture()
                row["end_capture"] = "ok" if g is not None else "ok (no graph)"
            except Exception as exc:  # noqa: BLE001
                row["end_capture"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
        try:
            cp.cuda.Device().synchronize()
        except Exception as exc:  # noqa: BLE001
            row["after"] = f"{type(exc).__name__}"
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        import cupy  # noqa: F401
    except ImportError as exc:
        print(f"capture_probe: needs CuPy and a GPU: {exc}", file=sys.stderr)
        return 2
    rows = probe()
    w = max(len(r["form"]) for r in rows)
    print(f"{'form':<{w}}  call (during capture)  ->  end_capture")
    for r in rows:
        print(f"{r['form']:<{w}}  {r['call']}  ->  {r['end_capture']}{'  after: ' + r['after'] if 'after' in r else ''}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

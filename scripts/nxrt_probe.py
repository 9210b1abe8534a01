"""What nxrt offers on this machine: its version and providers, its CUDA plugin EP's devices, and
whether lockstep's nxrt engines are available (with their reasons). Printed by the GPU lane's nxrt
step before the suite runs on them; nothing here is a test."""

from __future__ import annotations

import os
import sys


def main() -> int:
    print("python", sys.version.split()[0], "| LD_LIBRARY_PATH", os.environ.get("LD_LIBRARY_PATH", ""))
    try:
        import nxrt

        print("nxrt", nxrt.__version__, "providers:", nxrt.get_available_providers())
    except Exception as exc:  # the report says why, the run goes on
        print("nxrt: not importable:", type(exc).__name__, exc)
    try:
        import onnxruntime as ort

        print("onnxruntime", ort.__version__, ort.get_available_providers())
    except Exception as exc:
        print("onnxruntime: not importable:", type(exc).__name__, exc)
    from lockstep.engines.registry import load_engine

    for name in ("nxrt-cpu", "nxrt-cuda", "nxrt-ep-cpu", "nxrt-ep-cuda"):
        try:
            engine = load_engine(name)
            ok, why = engine.available()
            print(f"{name}: {'available' if ok else 'unavailable'}: {why}")
            if ok and hasattr(engine, "describe"):
                print(f"  {engine.describe()}")
        except Exception as exc:
            print(f"{name}: fails to load: {type(exc).__name__}: {exc}")
    try:
        import onnxruntime as ort

        for d in ort.get_ep_devices():
            print("ep device:", d.ep_name, d.ep_vendor, d.device.type, d.device.vendor_id, d.ep_metadata)
    except Exception as exc:
        print("ep devices: unreadable:", type(exc).__name__, exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())

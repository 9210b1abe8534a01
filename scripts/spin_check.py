"""Time the spin kernel on the GPU with CUDA events: the contract tests rely on it keeping the
stream busy for the time asked (they check queue state, not wall time, but need the work queued)."""

import cupy
from lockstep.kernels import primitives as P

out = cupy.zeros(1, cupy.int32)
s = cupy.cuda.Stream(non_blocking=True)
with s:
    P.spin.run(cupy, [out], {"microseconds": 1})  # compile
s.synchronize()
for us in (1_000, 100_000, 300_000):
    a, b = cupy.cuda.Event(), cupy.cuda.Event()
    with s:
        a.record(s)
        P.spin.run(cupy, [out], {"microseconds": us})
        b.record(s)
        queued = not s.done
    b.synchronize()
    print(f"spin {us:>7} us: {cupy.cuda.get_elapsed_time(a, b):9.3f} ms on the GPU; queued right after launch: {queued}")
print("spin-check passed" if int(out.get()[0]) == 4 else "spin-check FAILED: counter wrong")

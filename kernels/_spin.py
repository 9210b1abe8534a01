"""A kernel that keeps the GPU busy for a given time, so ordering bugs become observable there.

On the simulated device execution is lazy anyway, so the body only marks its output; on the GPU a
RawKernel spins on ``globaltimer`` for ``microseconds`` before writing, which keeps the stream busy
while the host races ahead. Tests use it to make "the work is still queued" true on real hardware.
"""

from __future__ import annotations

_SRC = r"""
extern "C" __global__ void lockstep_spin(int* out, unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
    out[0] = out[0] + 1;
}
"""

_kernel = None


def body(xp, out, *, microseconds):
    out[0:1] += 1


def cuda_body(xp, out, *, microseconds):
    global _kernel
    if _kernel is None:
        _kernel = xp.RawKernel(_SRC, "lockstep_spin")
    _kernel((1,), (1,), (out, xp.uint64(int(microseconds) * 1000)))

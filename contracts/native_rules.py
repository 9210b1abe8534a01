"""The C++/CUDA and Rust audit, its knowledge: which calls are unsafe while a CUDA graph is being
captured (the sinks, by kind, each kind with the reason CUDA gives), which tests say the stream is
capturing (the guards), what begins and ends a capture, and what drains a stream before an unmap.

The names are the CUDA runtime and driver APIs, Thrust, the Rust crates cudarc, cust and candle,
and the vocabulary of the seeds' Rust runtime (a ``synchronize`` that may be deferred,
``force_synchronize``, ``drain_for_unmap``, self-synchronising ``dtoh``/``dtod``). A user adds
their own in ``[tool.lockstep.audit]`` (``contracts/native_config.py``)."""

from __future__ import annotations

# -- why each kind is unsafe while capturing (what CUDA does) -------------------------------------
WHY = {
    "sync": "a stream/device/event/context synchronisation: illegal on a capturing stream (CUDA returns "
            "cudaErrorStreamCaptureUnsupported and invalidates the capture); a device-wide one also waits for "
            "the capture of every other thread",
    "sync-copy": "a synchronous copy or set (cudaMemcpy/cudaMemset and the crates' *_sync copies): it runs on the "
                 "legacy default stream and waits for it, which a capturing stream does not allow (the capture is "
                 "invalidated); a copy to the host also needs the value now, before the graph ever runs",
    "d2h-read": "a device-to-host copy recorded into the graph and then read by the host in the same call: while "
                "capturing nothing is copied (the copy runs only when the graph is launched), so the host reads a "
                "stale or uninitialised value, and on replay the copy lands after the host used it",
    "alloc": "an allocation or free outside the stream-ordered allocator (cudaMalloc/cudaFree, pinned host "
             "allocation, cuMemCreate/cuMemMap): a potentially unsafe API call that global and thread-local capture "
             "modes refuse (cudaErrorStreamCaptureUnsupported); cudaFree also synchronises the device. Use "
             "cudaMallocAsync/cudaFreeAsync on the capturing stream",
    "poll": "a poll of a stream or event (cudaStreamQuery/cudaEventQuery): illegal on a capturing stream, and it "
            "invalidates the capture",
    "legacy-stream": "work on the legacy default stream (a launch without a stream, or stream 0/NULL/nullptr/"
                     "cudaStreamLegacy): the legacy stream synchronises with every blocking stream, which is illegal "
                     "while one of them captures (cudaErrorStreamCaptureImplicit), and the work is not recorded into "
                     "the graph",
    "unmap": "cuMemUnmap/cuMemRelease/cuMemAddressFree: a virtual-memory call that is not permitted while capturing "
             "(and does not wait for kernels still reading the mapping); a recorded kernel that reads the mapping "
             "would read freed memory on replay",
    "thrust": "a Thrust algorithm synchronises its stream when it finishes unless run with "
              "thrust::cuda::par_nosync, and one that returns a value (reduce, count, ...) or fills a host_vector "
              "copies it to the host and waits: illegal while capturing",
}
# the rule that is not about capture: an unmap with no real drain before it (the seeds' use-after-unmap)
UNMAP_WHY = ("cuMemUnmap (or a free the configuration names) reached with no real drain of the compute stream "
             "before it on this chain: cuMemUnmap does not wait for kernels still queued or running, so one that "
             "reads the mapping after it is gone is a use-after-unmap (CUDA_ERROR_ILLEGAL_ADDRESS, or a read of "
             "whatever is mapped there next). Drain the compute stream (cuStreamSynchronize, a runtime's "
             "unconditional drain such as drain_for_unmap()) before the call, in this function or a caller")
# a barrier before an unmap that may not drain (the seeds' bug: `synchronize()` deferred by a flag)
DRAIN_WHY = ("a pre-unmap barrier that may not drain: its definition can return without draining the compute stream "
             "(a deferral flag), so the cuMemUnmap below it can run while kernels still read the mapping "
             "(use-after-unmap: CUDA_ERROR_ILLEGAL_ADDRESS). Call an unconditional drain (drain_for_unmap(), "
             "cuStreamSynchronize) here")

FIX = {
    "sync": "drop it (same-stream order already orders the kernels), guard it with the stream's capture status "
            "(cudaStreamIsCapturing / is_capturing()), or move it out of the capture path",
    "sync-copy": "use the stream-ordered form on the op's stream (cudaMemcpyAsync/cudaMemsetAsync, the crates' "
                 "async copies) and keep the value on the device, or guard it with the capture status",
    "d2h-read": "keep the value on the device (have the kernel read it), or read it only when not capturing",
    "alloc": "allocate before capture (a workspace), or use cudaMallocAsync/cudaFreeAsync on the capturing stream",
    "poll": "do not poll while capturing: guard it with the capture status",
    "legacy-stream": "launch on the op's stream: k<<<grid, block, smem, stream>>>, and pass the stream to every "
                     "*Async call",
    "unmap": "unmap outside the captured step (after a drain), never from a kernel's compute",
    "thrust": "run it with thrust::cuda::par_nosync.on(stream) and keep results on the device (cub::Device* into "
              "device memory), or guard it with the capture status",
}

# -- C and C++: free functions, by their last name --------------------------------------------------
C_SINKS = {
    **{n: "sync" for n in ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
                           "cudaThreadSynchronize", "cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize")},
    **{n: "sync-copy" for n in ("cudaMemcpy", "cudaMemcpy2D", "cudaMemcpy3D", "cudaMemcpyPeer", "cudaMemcpyToSymbol",
                                "cudaMemcpyFromSymbol", "cudaMemcpyToArray", "cudaMemcpyFromArray", "cudaMemcpy2DToArray",
                                "cudaMemcpy2DFromArray", "cudaMemset", "cudaMemset2D", "cudaMemset3D", "cuMemcpy",
                                "cuMemcpyDtoH", "cuMemcpyHtoD", "cuMemcpyDtoD", "cuMemcpy2D", "cuMemcpy3D",
                                "cuMemcpyPeer", "cuMemsetD8", "cuMemsetD16", "cuMemsetD32", "cuMemcpyDtoH_v2",
                                "cuMemcpyHtoD_v2", "cuMemcpyDtoD_v2", "cuMemsetD8_v2", "cuMemsetD16_v2",
                                "cuMemsetD32_v2")},
    **{n: "alloc" for n in ("cudaMalloc", "cudaMallocHost", "cudaHostAlloc", "cudaMallocManaged", "cudaMallocPitch",
                            "cudaMalloc3D", "cudaMallocArray", "cudaFree", "cudaFreeHost", "cudaFreeArray",
                            "cudaHostRegister", "cudaHostUnregister", "cuMemAlloc", "cuMemAlloc_v2", "cuMemAllocHost",
                            "cuMemHostAlloc", "cuMemAllocManaged", "cuMemAllocPitch", "cuMemFree", "cuMemFree_v2",
                            "cuMemFreeHost", "cuMemCreate", "cuMemMap", "cuMemHostRegister", "cuMemHostUnregister")},
    **{n: "poll" for n in ("cudaStreamQuery", "cudaEventQuery", "cuStreamQuery", "cuEventQuery")},
    **{n: "unmap" for n in ("cuMemUnmap", "cuMemRelease", "cuMemAddressFree")},
}
# async calls and the position of their stream argument; DEFAULTED: C++ gives it a default of 0
STREAM_ARG = {"cudaMemcpyAsync": 4, "cudaMemsetAsync": 3, "cudaMemcpy2DAsync": 6, "cudaMemset2DAsync": 5,
              "cudaMemcpy3DAsync": 1, "cudaMemcpyToSymbolAsync": 5, "cudaMemcpyFromSymbolAsync": 5,
              "cudaMemPrefetchAsync": 3, "cudaLaunchKernel": 5, "cudaLaunchCooperativeKernel": 5,
              "cudaEventRecord": 1, "cudaMallocAsync": 2, "cudaFreeAsync": 1, "cuMemcpyAsync": 3,
              "cuMemcpyHtoDAsync": 3, "cuMemcpyDtoHAsync": 3, "cuMemcpyDtoDAsync": 3, "cuMemsetD8Async": 3,
              "cuMemsetD16Async": 3, "cuMemsetD32Async": 3, "cuLaunchKernel": 9, "cuEventRecord": 1,
              "cuMemAllocAsync": 2, "cuMemFreeAsync": 1}
DEFAULTED = {"cudaMemcpyAsync", "cudaMemsetAsync", "cudaMemcpy2DAsync", "cudaMemset2DAsync", "cudaMemcpy3DAsync",
             "cudaMemcpyToSymbolAsync", "cudaMemcpyFromSymbolAsync", "cudaMemPrefetchAsync", "cudaLaunchKernel",
             "cudaEventRecord", "cudaLaunchCooperativeKernel"}
LEGACY_STREAMS = {"0", "NULL", "nullptr", "cudaStreamLegacy", "CU_STREAM_LEGACY", "(cudaStream_t)0",
                  "(cudaStream_t) 0", "cudaStream_t(0)", "(CUstream)0", "0u", "(cudaStream_t)nullptr"}
# device-to-host async copies: (name, position of the host destination, position of the kind or None)
D2H_ASYNC = {"cudaMemcpyAsync": (0, 3), "cudaMemcpy2DAsync": (0, 5), "cuMemcpyDtoHAsync": (0, None),
             "cuMemcpyDtoHAsync_v2": (0, None)}
D2H_KINDS = {"cudaMemcpyDeviceToHost"}

# Thrust: every algorithm synchronises unless run with par_nosync; these also return a host value
THRUST_ALGORITHMS = {
    "reduce", "reduce_by_key", "count", "count_if", "transform_reduce", "inner_product", "find", "find_if",
    "find_if_not", "all_of", "any_of", "none_of", "equal", "is_sorted", "is_sorted_until", "is_partitioned",
    "min_element", "max_element", "minmax_element", "mismatch", "sort", "sort_by_key", "stable_sort",
    "stable_sort_by_key", "copy", "copy_if", "copy_n", "transform", "transform_if", "fill", "fill_n", "sequence",
    "inclusive_scan", "exclusive_scan", "inclusive_scan_by_key", "exclusive_scan_by_key", "transform_inclusive_scan",
    "transform_exclusive_scan", "unique", "unique_copy", "unique_by_key", "remove", "remove_if", "remove_copy_if",
    "partition", "stable_partition", "gather", "scatter", "for_each", "for_each_n", "generate", "replace",
    "replace_if", "reverse", "lower_bound", "upper_bound", "binary_search", "merge", "set_union",
    "set_intersection", "adjacent_difference", "tabulate", "uninitialized_fill",
}
THRUST_VALUE = {"reduce", "count", "count_if", "transform_reduce", "inner_product", "find", "find_if", "find_if_not",
                "all_of", "any_of", "none_of", "equal", "is_sorted", "is_partitioned", "min_element", "max_element",
                "minmax_element", "mismatch", "is_sorted_until"}
THRUST_HOST_VECTOR = "thrust::host_vector"
THRUST_DEVICE_VECTOR = "thrust::device_vector"

# -- methods (C++ and Rust), by name: sinks whatever the receiver, unless the receiver's type is one
# the audited sources define with that method (then its definition is followed instead) ------------
METHOD_SINKS = {
    # CUDA streams/devices/contexts of every crate, and the seeds' runtime (synchronize may be deferred:
    # still a drain when not deferred, and a capture it meets is invalidated)
    "synchronize": "sync", "force_synchronize": "sync", "drain_for_unmap": "sync", "device_synchronize": "sync",
    "stream_synchronize": "sync",
    # cudarc
    "dtoh_sync_copy": "sync-copy", "dtoh_sync_copy_into": "sync-copy", "htod_sync_copy": "sync-copy",
    "htod_sync_copy_into": "sync-copy", "memcpy_dtov": "sync-copy", "memcpy_dtoh": "sync-copy",
    "clone_dtoh": "sync-copy", "sync_reclaim": "sync-copy",
    # candle
    "to_vec0": "sync-copy", "to_vec1": "sync-copy", "to_vec2": "sync-copy", "to_vec3": "sync-copy",
    "to_scalar": "sync-copy",
    # the seeds' runtime: self-synchronising copies
    "dtoh": "sync-copy", "dtod": "sync-copy",
}
# Rust-only method sinks (names too common in C++ to mean a CUDA copy there)
RUST_METHOD_SINKS = {"copy_to": "sync-copy", "copy_from": "sync-copy"}
# a poll, on a receiver whose text names a stream or an event
POLL_METHODS = {"query", "is_complete"}
POLL_RECEIVER_WORDS = ("stream", "event")
# Type::function paths (last two segments)
PATH_SINKS = {
    "DeviceBuffer::from_slice": "sync-copy", "DeviceBox::from_slice": "sync-copy",
    "DeviceBuffer::uninitialized": "alloc", "DeviceBuffer::zeroed": "alloc", "DeviceBox::new": "alloc",
    "DeviceBox::zeroed": "alloc", "DeviceBox::uninitialized": "alloc", "UnifiedBuffer::new": "alloc",
    "LockedBuffer::new": "alloc", "CurrentContext::synchronize": "sync",
}
# free functions of the runtime vocabulary (Rust and C++)
FREE_SINKS = {"force_synchronize": "sync", "drain_for_unmap": "sync", "dtoh": "sync-copy", "dtod": "sync-copy"}

# -- captures, guards, drains ------------------------------------------------------------------------
BEGIN_CAPTURE = {"cudaStreamBeginCapture", "cudaStreamBeginCaptureToGraph", "cuStreamBeginCapture",
                 "cuStreamBeginCapture_v2", "cuStreamBeginCaptureToGraph", "begin_capture"}
END_CAPTURE = {"cudaStreamEndCapture", "cuStreamEndCapture", "end_capture"}
# names whose truth says the stream is capturing (compared without case and underscores)
GUARD_WORDS = {"iscapturing", "capturing", "isstreamcapturing", "streamiscapturing", "incapture", "capturingactive",
               "iscaptureactive", "captureactive", "isgraphcapturing", "graphcapturing"}
# capture-status constants: equal to NONE = not capturing; equal to ACTIVE = capturing
STATUS_NONE = {"cudaStreamCaptureStatusNone", "CU_STREAM_CAPTURE_STATUS_NONE", "None"}
STATUS_ACTIVE = {"cudaStreamCaptureStatusActive", "CU_STREAM_CAPTURE_STATUS_ACTIVE", "Active"}
# real drains (a deferred `synchronize()` is not one)
DRAINS = {"drain_for_unmap", "force_synchronize", "cuStreamSynchronize", "cudaStreamSynchronize",
          "cudaDeviceSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cudaEventSynchronize"}
# the unmap itself: cuMemRelease of a handle that is still mapped only drops a reference (the memory
# stays mapped until cuMemUnmap), so it is no use-after-unmap by itself
UNMAPS = {"cuMemUnmap"}
# kernel launches (for the `launches-kernels` entry pattern)
LAUNCH_CALLS = {"cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel", "cuLaunchKernelEx",
                "cudaLaunchKernelEx", "launch", "launch_builder"}

CPP_EXTS = (".cu", ".cuh", ".cpp", ".cc", ".cxx", ".c", ".h", ".hpp", ".hh", ".hxx")
RUST_EXTS = (".rs",)
NATIVE_EXTS = CPP_EXTS + RUST_EXTS

# default capture entry points (a user's configuration may add to them or replace them)
DEFAULT_ENTRIES = ("*::ComputeInternal", "impl * for * { fn execute }", "impl * for * { fn compute }",
                   "impl * for * { fn forward }", "impl * for * { fn cuda_fwd }")

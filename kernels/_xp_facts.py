"""What an array-module call does with device values, one table per fact, shared by the static
sync audit (``contracts/audit_index.py``) and the simulated device's dynamic capture guard
(``reference_runtime/backends/_capture_guard.py``), so the two cannot disagree.

Measured on the H200 for CuPy (``scripts/capture_probe.py``, docs/cuda-semantics.md): a call whose
output shape depends on the values reads them back to size its output (refused during a CUDA graph
capture); a call that answers from metadata (shapes, dtypes, type predicates) returns a host value
and reads nothing.
"""

from __future__ import annotations

__all__ = ["DATA_DEPENDENT_SHAPE", "HOST_RESULT"]

# output shape depends on device values: CuPy reads them back (nonzero's count, unique's size...)
DATA_DEPENDENT_SHAPE = frozenset({
    "nonzero", "argwhere", "flatnonzero", "unique", "extract", "unique_all", "unique_counts", "unique_inverse",
    "unique_values", "compress", "intersect1d", "union1d", "setdiff1d", "setxor1d", "trim_zeros",
})

# the result is a host value computed from metadata (shapes, dtypes, types, address ranges), never
# from device values
HOST_RESULT = frozenset({
    "shape", "ndim", "size", "dtype", "result_type", "can_cast", "min_scalar_type", "promote_types",
    "issubdtype", "isdtype", "isscalar", "iscomplexobj", "isrealobj", "isfortran", "iterable", "common_type",
    "obj2sctype", "iinfo", "finfo", "broadcast_shapes", "normalize_axis_index", "get_array_module",
    "get_default_memory_pool", "get_default_pinned_memory_pool",
    "may_share_memory", "shares_memory",  # address-range overlap: host bookkeeping
})

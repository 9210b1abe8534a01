"""Source mutants of a sample of the ONNX operator kernels (kernels/), one ONNX guarantee each.

Most kernels run the same body on numpy and CuPy, so their mutants matter on both devices; an edit
of a CUDA source string (``_linalg``'s matmul RawKernel) only on the GPU (``devices=("cupy",)``).
Node-suite selections leave out the ``_expanded`` cases (they run the op's function body, not
its kernel).
"""

from lockstep.contracts.mutation import Mutant

_K = "lockstep.kernels."
_NODE = ("conformance/node_suite/test_node_cases.py",)
_CASES = ("tests/test_kernel_cases.py",)
_INDEX = ("tests/test_index_checks.py",)


def _node(*names: str) -> str:
    """A -k expression: any of these node-case name fragments, no function-expanded variant."""
    return f"({' or '.join(names)}) and not expanded"


MUTANTS = [
    # -- elementwise ----------------------------------------------------------------------------
    Mutant(
        "kernels", "mod_sign_of_dividend", _K + "_elementwise_util",
        old="adjust = (r != 0) & ((r < 0) != (b < 0))\n    r = xp.where(adjust, r + b, r)",
        new="adjust = (r != 0) & ((r < 0) != (a < 0))\n    r = xp.where(adjust, r + b, r)",
        breaks="float Mod with fmod=0 takes the divisor's sign (a - floor(a/b)*b), not the dividend's",
        tests=_NODE, select=_node("test_mod_"), ci=True,
    ),
    Mutant(
        "kernels", "legacy_broadcast_axis_zero", _K + "ops_elementwise",
        old="        axis = ra - rb\n",
        new="        axis = 0\n",
        breaks="a legacy (opset < 7) broadcast=1 B without axis lines up with A's trailing dims (a suffix)",
        tests=_CASES, select="legacy_broadcast",
    ),
    # -- reductions -----------------------------------------------------------------------------
    Mutant(
        "kernels", "reduce_noop_ignored", _K + "_reduce_util",
        old="return () if noop else tuple(range(rank))",
        new="return tuple(range(rank))",
        breaks="empty axes with noop_with_empty_axes=1 reduce nothing (the input passes through)",
        tests=_NODE, select=_node("test_reduce_sum_empty_axes"), ci=True,
    ),
    Mutant(
        "kernels", "reduce_negative_axis_not_wrapped", _K + "_reduce_util",
        old="n = a % rank if rank else 0",
        new="n = a if rank else 0",
        breaks="a negative reduction axis counts from the end (axis + rank)",
        tests=_NODE, select=_node("test_reduce_sum_negative_axes", "test_reduce_max_negative_axes"),
    ),
    Mutant(
        "kernels", "reduce_half_accumulates_in_half", _K + "_reduce_util",
        old="if dt.itemsize < 4 and is_float(dt):",
        new="if dt.itemsize < 2 and is_float(dt):",
        breaks="float16/bfloat16 sum-like reductions accumulate in float32 (a total past float16's range is no inf)",
        tests=_CASES, select="float16_reductions",
    ),
    # -- MatMul / Gemm ----------------------------------------------------------------------------
    Mutant(
        "kernels", "nbits_host_prefill_reads_low_nibble_twice", _K + "_nbits_host",
        old="out[r, base + 2 * j + 1] = (np.float32(v >> 4) - z) * s",
        new="out[r, base + 2 * j + 1] = (np.float32(v & 15) - z) * s",
        breaks="the 4-bit MatMulNBits product of several rows reads each byte's high nibble as the odd value",
        tests=("tests/test_nbits_host.py",), ci=True,
    ),
    Mutant(
        "kernels", "nbits_host_thread_split_drops_a_row", "lockstep.host_threads",
        old="min(r1, lo + step)",
        new="min(r1, lo + step) - 1",
        breaks="the rows of a threaded 4-bit MatMulNBits product are split over the threads with none left out",
        tests=("tests/test_nbits_host.py",),
    ),
    Mutant(
        "kernels", "gemm_beta_is_alpha", _K + "ops_linalg",
        old="y = y + _scale(xp, c, beta, dtype)",
        new="y = y + _scale(xp, c, alpha, dtype)",
        breaks="Gemm scales C by beta (and A*B by alpha), not both by alpha",
        tests=_NODE, select=_node("test_gemm_"),
    ),
    Mutant(
        "kernels", "matmul_cuda_skips_last_batch", _K + "_linalg",
        old="for (long long b = blockIdx.z; b < batch; b += gridDim.z)",
        new="for (long long b = blockIdx.z; b < batch - 1; b += gridDim.z)",
        breaks="the matmul kernel computes every batch of a batched product",
        tests=_NODE + _CASES, select=_node("test_matmul_", "matmul_spans"), devices=("cupy",),
    ),
    Mutant(
        "kernels", "matmul_cuda_tile_drops_last_k", _K + "_linalg",
        old="for (int kk = 0; kk < 16; ++kk)",
        new="for (int kk = 0; kk < 15; ++kk)",
        breaks="the matmul kernel accumulates all 16 k of every tile (K >= 16 spans several)",
        tests=_CASES, select="matmul_spans", devices=("cupy",),
    ),
    Mutant(
        "kernels", "matmul_cuda_int64_accumulates_int32", _K + "_linalg",
        old='"int64": ("long long", "long long"),',
        new='"int64": ("long long", "int"),',
        breaks="int64 matrix products accumulate in int64 (no wrap at 32 bits)",
        tests=_CASES, select="matmul_int64", devices=("cupy",),
    ),
    Mutant(
        "kernels", "matmul_warp_tree_drops_half", _K + "_linalg",
        old="for (int off = 16; off > 0; off >>= 1) {{",
        new="for (int off = 8; off > 0; off >>= 1) {{",
        breaks="a decode product sums every k: the warp kernel folds all 32 lanes (the CUDA source)",
        tests=_CASES, select="decode_rows", devices=("cupy",),
    ),
    # -- softmax, normalizations ------------------------------------------------------------------
    Mutant(
        "kernels", "softmax_no_max_shift", _K + "ops_nn",
        old="e = xp.exp(x - xp.max(x, axis=axis, keepdims=True))",
        new="e = xp.exp(x)",
        breaks="Softmax subtracts the row maximum, so large logits do not overflow to inf/NaN",
        tests=_NODE, select=_node("test_softmax_"),
    ),
    Mutant(
        "kernels", "softmax_legacy_default_axis", _K + "ops_nn",
        old='int(node.attr("axis", -1 if node.opset >= 13 else 1))',
        new='int(node.attr("axis", -1))',
        breaks="Softmax/LogSoftmax before opset 13 default to axis=1 over the flattened trailing block",
        tests=_CASES, select="softmax",
    ),
    Mutant(
        "kernels", "layer_norm_last_axis_only", _K + "ops_nn",
        old="mean, d, var = _moments(xp, xw, tuple(range(axis, x.ndim)))",
        new="mean, d, var = _moments(xp, xw, (axis,))",
        breaks="LayerNormalization normalizes over every axis from `axis` to the last",
        tests=_NODE, select=_node("test_layer_normalization_4d_axis"),
    ),
    Mutant(
        "kernels", "rms_norm_epsilon_outside_sqrt", _K + "ops_nn",
        old="y = xw * (1.0 / xp.sqrt(ms + _f(node, \"epsilon\", 1e-5)))",
        new="y = xw * (1.0 / (xp.sqrt(ms) + _f(node, \"epsilon\", 1e-5)))",
        breaks="RMSNormalization adds epsilon to the mean square, inside the square root",
        tests=_NODE, select=_node("test_rms_normalization"),
        devices=("sim",),  # on CuPy the fused RawKernel (rms_norm_cuda_epsilon_outside_sqrt) runs instead
    ),
    Mutant(
        "kernels", "rms_norm_cuda_epsilon_outside_sqrt", _K + "_fused",
        old="const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, eps)));",
        new="const float inv = __fdiv_rn(1.0f, __fadd_rn(__fsqrt_rn(ms), eps));",
        breaks="RMSNormalization adds epsilon to the mean square, inside the square root (the fused CUDA kernel)",
        tests=_NODE, select=_node("test_rms_normalization"), devices=("cupy",),
    ),
    # -- attention, rotary ------------------------------------------------------------------------
    Mutant(
        "kernels", "attention_causal_ignores_past", _K + "_attention",
        old="bias = offset_bias(base, j_idx <= i_idx + offset)",
        new="bias = offset_bias(base, j_idx <= i_idx)",
        breaks="with a KV cache, causal query i sees every key up to past + i (not just up to i)",
        tests=_NODE, select=_node("test_attention_4d_causal_with_past", "test_attention_4d_with_past_and_present"),
    ),
    Mutant(
        "kernels", "rotary_check_off_by_one", _K + "_attention",
        old="return [IndexCheck(3, 0, min(specs[1].shape[0], specs[2].shape[0]), by=(1, 2))]",
        new="return [IndexCheck(3, 0, min(specs[1].shape[0], specs[2].shape[0]) + 1, by=(1, 2))]",
        breaks="a rotary position_id equal to the cache's row count is flagged (valid rows are [0, rows))",
        tests=_INDEX, select="rotary",
    ),
    # -- index ops and the latch ------------------------------------------------------------------
    Mutant(
        "kernels", "negative_index_not_wrapped", _K + "_index_util",
        old="idx = xp.where(idx < 0, idx + dim, idx)",
        new="idx = xp.where(idx < 0, idx * 0, idx)",
        breaks="Gather/GatherElements/ScatterND wrap a negative index to index + dim",
        tests=_NODE, select=_node("test_gather_negative", "test_gather_elements_negative"), ci=True,
    ),
    Mutant(
        "kernels", "latch_upper_bound_inclusive", _K + "_latch",
        old="bad = xp.logical_or(idx < lo, idx >= hi)",
        new="bad = xp.logical_or(idx < lo, idx > hi)",
        breaks="an index equal to the axis size is out of range and flagged into the error latch",
        tests=_INDEX, select="device_assert and not golden", ci=True,
        devices=("sim",),  # on CuPy one RawKernel flags (latch_cuda_upper_bound_inclusive)
    ),
    Mutant(
        "kernels", "latch_cuda_upper_bound_inclusive", _K + "_fast",
        old="bool bad = (v < lo) || (v >= hi);",
        new="bool bad = (v < lo) || (v > hi);",
        breaks="an index equal to the axis size is out of range and flagged into the error latch (the CUDA flag kernel)",
        tests=_INDEX, select="device_assert and not golden", devices=("cupy",),
    ),
    Mutant(
        "kernels", "latch_later_site_overwrites", _K + "_latch",
        old="where=xp.logical_and(flag, latch[0:1] == 0))",
        new="where=flag)",
        breaks="a latch already set keeps the site that set it first (DeviceAssert names the first node)",
        tests=_CASES, select="latch",
        devices=("sim",),  # on CuPy one RawKernel flags (latch_cuda_later_site_overwrites)
    ),
    Mutant(
        "kernels", "latch_cuda_later_site_overwrites", _K + "_fast",
        old="if (atomicCAS(&latch[0], 0, 1) == 0) latch[1] = site;",
        new="atomicExch(&latch[0], 1); latch[1] = site;",
        breaks="a latch already set keeps the site that set it first (the CUDA flag kernel)",
        tests=_CASES, select="latch", devices=("cupy",),
    ),
    Mutant(
        "kernels", "recording_module_refuses_nothing", _K + "_launch",
        old='        if name not in self.SAFE:\n            self._rec.refuse(f"xp.{name}")',
        new="        if False:\n            pass",
        breaks="a body whose device work is more than RawKernel launches (CuPy ops) is never relaunched from a partial record",
        tests=("tests/test_launch_replay.py",), select="latch", devices=("cupy",),
    ),
    Mutant(
        "kernels", "gather_checked_allows_negative", _K + "primitives",
        old="flag_out_of_range(xp, latch, idx, 0, n, site)",
        new="flag_out_of_range(xp, latch, idx, -n, n, site)",
        breaks="the gather_checked primitive's valid indices are [0, n): a negative one sets the latch",
        tests=("contracts/suite/runtime/test_memory_contracts.py",), select="latch",
    ),
    Mutant(
        "kernels", "scatter_reduce_scan_skips_segment_start", _K + "_index_util",
        old="ok = (pos - d >= first).reshape(-1, 1)",
        new="ok = (pos - d > first).reshape(-1, 1)",
        breaks="ScatterND/ScatterElements with a reduction fold every update of a duplicate target",
        tests=_NODE, select=_node("test_scatternd_add", "test_scatternd_multiply", "test_scatter_elements_with_duplicate"),
    ),
    Mutant(
        "kernels", "topk_ties_by_higher_index", _K + "ops_index",
        old="order = xp.flip(xp.argsort(xp.flip(x, axis), axis=axis, kind=\"stable\"), axis)\n        order = (n - 1) - order",
        new="order = xp.flip(xp.argsort(x, axis=axis, kind=\"stable\"), axis)",
        breaks="TopK(largest=1) breaks ties by the lower index",
        tests=_NODE, select=_node("test_top_k"),
    ),
    Mutant(
        "kernels", "cumsum_exclusive_shifts_wrong_way", _K + "ops_index",
        old="sl[axis] = slice(0, n - 1)",
        new="sl[axis] = slice(1, n)",
        breaks="exclusive CumSum's element i sums the elements before i (in scan order)",
        tests=_NODE, select=_node("test_cumsum"),
    ),
    Mutant(
        "kernels", "onehot_negative_not_wrapped", _K + "ops_index",
        old="i = xp.where(i < 0, i + depth, i)",
        new="i = xp.where(i < 0, i, i)",
        breaks="OneHot wraps a negative index to index + depth",
        tests=_NODE, select=_node("test_onehot"),
    ),
    # -- shape ops ------------------------------------------------------------------------------
    Mutant(
        "kernels", "slice_negative_step_end_clamped_to_zero", _K + "ops_shape",
        old="s, e = min(max(s, 0), dim - 1), min(max(e, -1), dim - 1)",
        new="s, e = min(max(s, 0), dim - 1), min(max(e, 0), dim - 1)",
        breaks="with a negative step, an end before the axis start clamps to -1 (element 0 included)",
        tests=_NODE + _CASES, select=_node("test_slice", "slice"),
    ),
    Mutant(
        "kernels", "range_int_count_floors", _K + "ops_shape",
        old="n = max(-(-(l - s) // d), 0)",
        new="n = max((l - s) // d, 0)",
        breaks="Range's element count is ceil((limit - start) / delta) (integer inputs)",
        tests=_NODE + _CASES, select=_node("test_range", "range"),
    ),
    Mutant(
        "kernels", "range_float_count_truncates", _K + "ops_shape",
        old="n = max(math.ceil((l - s) / d), 0)",
        new="n = max(int((l - s) / d), 0)",
        breaks="Range's element count is ceil((limit - start) / delta) (float inputs)",
        tests=_NODE + _CASES, select=_node("test_range", "range"),
    ),
    Mutant(
        "kernels", "split_num_outputs_floor_chunk", _K + "ops_shape",
        old="chunk = -(-dim // n)",
        new="chunk = dim // n",
        breaks="Split with num_outputs makes chunks of ceil(dim / n), the last one smaller",
        tests=_NODE, select=_node("test_split_"),
    ),
    Mutant(
        "kernels", "expand_takes_the_requested_shape", _K + "ops_shape",
        old="return [Spec(broadcast(node, x.shape, shape), x.dtype)]",
        new="return [Spec(tuple(shape), x.dtype)]",
        breaks="Expand's output is the broadcast of the input's shape and the shape input (a 1 keeps the input's dim)",
        tests=_NODE, select=_node("test_expand_"),
    ),
    Mutant(
        "kernels", "reflect_pad_repeats_edge", _K + "_shape_util",
        old="return np.where(m < n, m, period - m)",
        new="return np.where(m < n, m, period - m + 1)",
        breaks="reflect padding mirrors without repeating the edge element",
        tests=_NODE, select=_node("test_reflect_pad", "test_edge_pad", "test_wrap_pad", "test_constant_pad"),
    ),
    # -- cast, conv, pool ---------------------------------------------------------------------------
    Mutant(
        "kernels", "cast_saturate_default_off", _K + "ops_cast",
        old='return bool(node.attr("saturate", 1)) if node.opset >= 19 else True',
        new='return bool(node.attr("saturate", 0)) if node.opset >= 19 else True',
        breaks="Cast to float8 saturates out-of-range values by default (saturate=1)",
        tests=_NODE, select=_node("test_cast_FLOAT_to_FLOAT8", "test_cast_no_saturate_FLOAT_to_FLOAT8"),
    ),
    Mutant(
        "kernels", "cast_small_int_truncates", _K + "_cast_util",
        old="xp.where(xp.isfinite(v), xp.rint(v), 0.0)",
        new="xp.where(xp.isfinite(v), xp.trunc(v), 0.0)",
        breaks="Cast from a float to int4/uint4/int2/uint2 rounds half to even before it keeps the low bits "
               "(ml_dtypes' astype truncates toward zero)",
        tests=("tests/test_raw_storage.py",), select="rounds_half_to_even",
    ),
    Mutant(
        "kernels", "small_decode_mode_gets_raw_bits", _K + "_small",
        old="args = [decode(xp, a, t) if a is not None and is_small(t) else a for a, t in zip(args, node.in_dtypes)]",
        new="args = [a for a, t in zip(args, node.in_dtypes)]",
        breaks="on a raw-bit device a kernel gets a small-type input's value (decoded exactly), not its storage bits",
        tests=("tests/test_raw_storage.py",), select="decode_path or ref_sims_bits", ci=True,
    ),
    Mutant(
        "kernels", "small_results_saturate", _K + "_small",
        old='encode(xp, r, dst, saturate=False, round_mode="nearest")',
        new='encode(xp, r, dst, saturate=True, round_mode="nearest")',
        breaks="a computed small-type result past the type's range overflows as ml_dtypes' astype (bfloat16: inf)",
        tests=("tests/test_raw_storage.py",), select="decode_path",
    ),
    Mutant(
        "kernels", "conv_pads_symmetric", _K + "_conv_util",
        old="b, e = pads[i], pads[i + nsp]",
        new="b, e = pads[i], pads[i]",
        breaks="pads list every axis's begin pads, then every axis's end pads (asymmetric padding)",
        tests=_NODE + _CASES, select=_node("test_conv_with_strides", "test_averagepool_2d_pads", "asymmetric_pads"),
    ),
    Mutant(
        "kernels", "same_lower_pads_like_upper", _K + "_conv_util",
        old='b = small if auto_pad == "SAME_UPPER" else total - small',
        new='b = small',
        breaks="auto_pad SAME_LOWER puts the odd extra pad at the beginning, SAME_UPPER at the end",
        tests=_NODE, select=_node("same_lower", "same_upper"),
    ),
    Mutant(
        "kernels", "window_cache_evicts_one_row_at_a_time", _K + "ops_contrib_gqa",
        old="    g = capacity - window + 1\n    over = xp.maximum(t - capacity, 0)",
        new="    g = 1\n    over = xp.maximum(t - capacity, 0)",
        breaks="a window-sized cache (GroupQueryAttention sliding_window_cache=1) of capacity C and window W "
               "evicts G = C - W + 1 positions at once, as ONNX Runtime's schema documents",
        tests=("tests/test_contrib_ops.py",), select="window_sized_cache",
    ),
]

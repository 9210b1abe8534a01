"""Device math for the com.microsoft contrib ops (``ops_contrib``, ``ops_contrib_attention``): n-bit
weight unpacking and the pieces of the attention ops (rotary embedding, KV-cache assembly, masked
softmax attention, and the additive-mask softmax attention of MultiHeadAttention and Attention).

Everything here takes ``xp`` (numpy or CuPy), uses only functions both share, never reads device
values on the host, and does its matrix products through ``_linalg.matmul``.
"""

from __future__ import annotations

import numpy as np

from ._linalg import matmul

__all__ = ["additive_attention", "assemble_cache", "attention", "cast", "dequantize_blocks", "pad_specs", "rotary", "unpack_bits",
           "work_dtype"]


def work_dtype(*dtypes) -> np.dtype:
    """float64 when any of ``dtypes`` is float64, else float32 (float16/bfloat16 are promoted)."""
    return np.dtype(np.float64) if any(np.dtype(d) == np.float64 for d in dtypes if d is not None) \
        else np.dtype(np.float32)


def unpack_bits(xp, packed, bits: int):
    """uint8 ``packed[..., n]`` -> uint8 ``[..., n * (8 // bits)]``: each byte holds ``8 // bits``
    values, the first in the lowest bits (ORT's MatMulNBits layout)."""
    per = 8 // bits
    mask = (1 << bits) - 1
    packed = packed.astype(xp.uint8, copy=False)
    if per == 1:
        return packed
    parts = [(packed >> (i * bits)) & mask for i in range(per)]
    out = xp.stack(parts, axis=-1)
    return out.reshape(packed.shape[:-1] + (packed.shape[-1] * per,))


def dequantize_blocks(xp, b, scales, zero_points, *, n: int, k: int, bits: int, block: int, work):
    """The ``[N, K]`` float weight of MatMulNBits: ``(q - zero_point) * scale`` per block of K.

    ``b``: uint8 ``N * n_blocks * block * bits / 8`` values; ``scales``: ``N * n_blocks``;
    ``zero_points``: None (``2**(bits-1)``), packed uint8 (``N * ceil(n_blocks * bits / 8)``) or
    float (``N * n_blocks``)."""
    nb = -(-k // block)
    q = unpack_bits(xp, b.reshape(n, nb * block * bits // 8), bits).reshape(n, nb, block)
    s = scales.reshape(n, nb).astype(work)
    if zero_points is None:
        zp = work.type(1 << (bits - 1))
        w = (q.astype(work) - zp) * s[:, :, None]
    else:
        if zero_points.dtype == np.uint8:
            zb = -(-nb * bits // 8)
            zp = unpack_bits(xp, zero_points.reshape(n, zb), bits)[:, :nb].astype(work)
        else:
            zp = zero_points.reshape(n, nb).astype(work)
        w = (q.astype(work) - zp[:, :, None]) * s[:, :, None]
    return w.reshape(n, nb * block)[:, :k]


def rotary(xp, x, cos, sin, interleaved: bool):
    """Rotary embedding of the first ``2 * cos.shape[-1]`` features of ``x`` [B, H, S, D];
    ``cos``/``sin`` are [B, 1, S, D_rot/2] (already gathered at each token's position)."""
    half = cos.shape[-1]
    rd = 2 * half
    xr = x[..., :rd]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        o = xp.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), axis=-1).reshape(xr.shape)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        o = xp.concatenate((x1 * cos - x2 * sin, x2 * cos + x1 * sin), axis=-1)
    if rd == x.shape[-1]:
        return o
    return xp.concatenate((o, x[..., rd:]), axis=-1)


def assemble_cache(xp, new, past, past_len, length: int):
    """ORT's present KV buffer [B, H, length, D] (non-shared output buffer): for batch entry b,
    rows ``[0, past_len[b])`` come from ``past``, rows ``[past_len[b], past_len[b] + S)`` are
    ``new`` [B, H, S, D], every other row is zero.  ``past_len``: int64 [B] on the device."""
    B, H, S, D = new.shape
    rel = xp.arange(length, dtype=xp.int64).reshape(1, 1, length, 1) - past_len.reshape(B, 1, 1, 1)
    idx = xp.broadcast_to(xp.clip(rel, 0, S - 1), (B, H, length, D))
    gathered = xp.take_along_axis(new, idx, axis=2)
    zero = new.dtype.type(0)
    out = xp.where((rel >= 0) & (rel < S), gathered, zero)
    if past is not None and past.shape[2] > 0:
        p = past.astype(new.dtype, copy=False)
        if p.shape[2] < length:
            p = xp.concatenate((p, xp.zeros((B, H, length - p.shape[2], D), dtype=new.dtype)), axis=2)
        elif p.shape[2] > length:
            p = p[:, :, :length]
        out = xp.where(rel < 0, p, out)
    return out


def attention(xp, q, k, v, allowed, *, scale: float, softcap: float):
    """Grouped-query attention: ``q`` [B, Nq, S, D], ``k``/``v`` [B, Nkv, L, D] (query head h reads
    kv head ``h // (Nq // Nkv)``), ``allowed`` bool broadcasting to [B, 1, S, L].  Rows with no
    allowed key give zeros (as ORT's CPU provider does).  Returns [B, Nq, S, D]."""
    B, nq, S, D = q.shape
    nkv, L = k.shape[1], k.shape[2]
    g = nq // nkv
    wt = q.dtype.type
    qg = q.reshape(B, nkv, g * S, D)
    scores = matmul(xp, qg, xp.swapaxes(k, -1, -2)).reshape(B, nq, S, L) * wt(scale)
    if softcap > 0:
        scores = xp.tanh(scores / wt(softcap)) * wt(softcap)
    neg = wt(-np.inf)
    masked = xp.where(allowed, scores, neg)
    m = xp.max(masked, axis=-1, keepdims=True)
    m = xp.where(m == neg, wt(0), m)
    e = xp.where(allowed, xp.exp(masked - m), wt(0))
    denom = xp.sum(e, axis=-1, keepdims=True)
    probs = e / xp.where(denom == 0, wt(1), denom)
    out = matmul(xp, probs.reshape(B, nkv, g * S, L), v)
    return out.reshape(B, nq, S, D)


def additive_attention(xp, q, k, v, add, *, scale: float):
    """ONNX Runtime's CPU attention (MultiHeadAttention, Attention): ``softmax(scale * q.k + add) v``
    for ``q`` [B, N, S, D], ``k`` [B, N, T, D], ``v`` [B, N, T, Dv] (work dtype) and ``add`` (the
    attention bias plus the masks as ``mask_filter_value``, not -inf: a fully masked row is a softmax
    over its biased scores, as ORT's is) broadcasting to [B, N, S, T], or None.  Returns [B, N, S, Dv]."""
    wt = q.dtype.type
    scores = matmul(xp, q, xp.swapaxes(k, -1, -2)) * wt(scale)
    if add is not None:
        scores = scores + add
    m = xp.max(scores, axis=-1, keepdims=True)
    e = xp.exp(scores - m)
    probs = e / xp.sum(e, axis=-1, keepdims=True)
    return matmul(xp, probs, v)


def cast(x, dtype):
    """``x`` in ``dtype`` (itself when it already is)."""
    return x if x.dtype == dtype else x.astype(dtype)


def pad_specs(specs, n):
    """The node's input specs padded with None to ``n`` (absent optional inputs)."""
    return list(specs) + [None] * (n - len(specs))

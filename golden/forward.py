"""The one float64 numpy forward of the Llama architecture: RMSNorm, rotate-half (non-interleaved)
RoPE, grouped-query attention, SiLU-gated MLP. The golden models (``golden/models/build.py``:
``reference_forward``, the near-tie planting) and the Llama exporter's check (``golden/llama_export.py``:
``llama_forward``) are thin adapters over ``forward``; both are written independently of any ONNX graph.

Weights (float64, ``[in, out]`` layout, used as ``h @ W``):

- ``embed_tokens.weight`` [vocab, hidden], ``norm.weight`` [hidden], ``lm_head.weight`` [hidden, vocab];
- per layer ``layers.{l}.``: ``attn_norm.weight``, ``q_proj.weight`` [hidden, n_heads*head_dim],
  ``k_proj.weight``/``v_proj.weight`` [hidden, n_kv_heads*head_dim], ``o_proj.weight``
  [n_heads*head_dim, hidden], ``mlp_norm.weight``, ``gate_proj.weight``/``up_proj.weight``
  [hidden, d_ff], ``down_proj.weight`` [d_ff, hidden].

The golden models' bytes depend on this function's exact float64 results (the near-tie planting
reads its hidden states): keep the expression order and the matmul layouts as they are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["forward", "rms_norm", "rope_tables"]


def rope_tables(head_dim: int, theta: float, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """float64 (cos, sin) [max_positions, head_dim/2]: angle ``p * theta^(-2i/head_dim)``."""
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (np.arange(half, dtype=np.float64) * 2.0 / head_dim)
    angles = np.arange(max_positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles), np.sin(angles)


def rms_norm(x: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
    return x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)) * scale


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x (B, H, S, D); cos, sin (B, S, D/2): non-interleaved halves (x*cos + rotate_half(x)*sin)."""
    half = x.shape[-1] // 2
    c, s = cos[:, None], sin[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate((c * x1 - s * x2, s * x1 + c * x2), axis=-1)


def forward(w: Mapping[str, np.ndarray], input_ids: np.ndarray, position_ids: np.ndarray, *, n_layers: int,
            n_heads: int, n_kv_heads: int, head_dim: int, eps: float, cos: np.ndarray, sin: np.ndarray,
            past: Sequence[tuple[np.ndarray, np.ndarray]] | None = None, attention_mask: np.ndarray | None = None):
    """``(logits (B, S, vocab), [(present_key, present_value) per layer], hidden (B, S, hidden))``.

    ``input_ids``, ``position_ids`` (B, S) int; ``cos``, ``sin`` the rope tables [positions, D/2],
    read at ``position_ids``; ``past`` one (key, value) pair (B, n_kv_heads, past_seq, head_dim) per
    layer (None: empty); query ``s`` attends key ``t`` iff ``t <= position_ids[b, s]`` and, given an
    ``attention_mask`` (B, past_seq + S), ``attention_mask[b, t] != 0`` (no escape for its own key)."""
    input_ids, position_ids = np.asarray(input_ids), np.asarray(position_ids)
    B, S = input_ids.shape
    H, KV, D = n_heads, n_kv_heads, head_dim
    x = w["embed_tokens.weight"][input_ids]
    cos, sin = cos[position_ids], sin[position_ids]
    presents = []
    for l in range(n_layers):
        p = f"layers.{l}."
        h = rms_norm(x, w[p + "attn_norm.weight"], eps)
        q = (h @ w[p + "q_proj.weight"]).reshape(B, S, H, D).transpose(0, 2, 1, 3)
        k = (h @ w[p + "k_proj.weight"]).reshape(B, S, KV, D).transpose(0, 2, 1, 3)
        v = (h @ w[p + "v_proj.weight"]).reshape(B, S, KV, D).transpose(0, 2, 1, 3)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if past is not None:
            pk, pv = (np.asarray(a, dtype=np.float64) for a in past[l])
        else:
            pk = pv = np.zeros((B, KV, 0, D))
        k, v = np.concatenate((pk, k), axis=2), np.concatenate((pv, v), axis=2)
        presents.append((k, v))
        T = k.shape[2]
        allowed = np.arange(T)[None, None, None, :] <= position_ids[:, None, :, None]  # (B, 1, S, T)
        if attention_mask is not None:  # causal AND mask (no escape)
            allowed = allowed & (np.asarray(attention_mask)[:, None, None, :] != 0)
        kr, vr = np.repeat(k, H // KV, axis=1), np.repeat(v, H // KV, axis=1)  # head j reads kv head j // (H/KV)
        scores = (q @ kr.swapaxes(-1, -2)) / np.sqrt(D)
        scores = np.where(allowed, scores, -np.inf)
        e = np.exp(scores - scores.max(axis=-1, keepdims=True))
        att = (e / e.sum(axis=-1, keepdims=True)) @ vr  # (B, H, S, D)
        x = x + att.transpose(0, 2, 1, 3).reshape(B, S, H * D) @ w[p + "o_proj.weight"]
        h = rms_norm(x, w[p + "mlp_norm.weight"], eps)
        g, u = h @ w[p + "gate_proj.weight"], h @ w[p + "up_proj.weight"]
        x = x + (g / (1.0 + np.exp(-g)) * u) @ w[p + "down_proj.weight"]
    hidden = rms_norm(x, w["norm.weight"], eps)
    return hidden @ w["lm_head.weight"], presents, hidden

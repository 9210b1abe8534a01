"""Golden model specifications: one frozen ``ModelSpec`` per variant, and the planted near-tie.

A spec is everything the generator needs: ``build(spec)`` (``golden.models.build``) is a pure
function of it, so the manifest's sha256 of a variant only moves when its spec, the generator
(``GENERATOR_VERSION``) or the serialization of onnx itself moves.

The four ``tiny-*`` variants share seed and weights (generated in float64, then cast), so fp32
versus fp16 and standard versus decomposed compute the same function up to the dtype's rounding.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["GENERATOR_VERSION", "NEAR_TIE", "PROMPT", "VARIANTS", "ModelSpec", "NearTie", "spec_dict"]

GENERATOR_VERSION = "3"  # 2: scalar constants rank 0 (Range bounds, GQA total_sequence_length); 3: a kv64 flavour emits only its own write

# The prompt the golden checks (greedy output, the planted near-tie) are stated against; tokens
# are its UTF-8 bytes (the models are byte-level: vocab 256, token id = byte value).
PROMPT = "The quick brown fox"


@dataclass(frozen=True)
class NearTie:
    """A planted near-tie: for ``prompt`` (position_ids 0..n-1, no past) the logits at ``position``
    have ``top1`` first and ``top2`` second, ``margin`` apart (float64 forward of the stored weights).

    ``build`` plants it with a rank-one correction to the lm_head column of ``top2`` and refuses to
    build when the tokens it finds differ from the recorded ones."""

    prompt: str
    position: int
    top1: int
    top2: int
    margin: float


@dataclass(frozen=True)
class ModelSpec:
    """A byte-level decoder LM (see golden/models/README.md for the graph)."""

    name: str
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    d_ff: int = 128
    vocab: int = 256
    rope_theta: float = 10000.0
    eps: float = 1e-5
    max_positions: int = 512
    dtype: str = "float32"  # "float32" | "float16"
    flavour: str = "standard"  # "standard" (opset 23 fused ops) | "decomposed" (MatMul/Softmax/elementwise) | "genai"
    seed: int = 20240607
    # Weight scales. Every projection is drawn N(0, 1) * scale / sqrt(fan_in); norm scales are
    # 1 + norm_jitter * N(0, 1); the embedding is N(0, 1) * embed_scale.
    embed_scale: float = 1.0
    qk_scale: float = 2.0  # W_q and W_k: sharpens attention (scores of a few units)
    proj_scale: float = 1.0  # W_v, W_o, W_gate, W_up, W_down
    lm_head_scale: float = 4.0  # logits spread of several units
    norm_jitter: float = 0.1
    near_tie: NearTie | None = None
    # Fixed-capacity KV cache: past/present are [batch, kv_heads, kv_capacity, head_dim] and a step
    # writes its keys/values at its positions (TensorScatter in the standard flavour, a one-hot
    # MatMul in the decomposed one), so decode steps have fixed shapes. None: a growing cache.
    kv_capacity: int | None = None
    # Projection weights quantized to 4-bit blocks (symmetric, zero point 8, ``int4_block`` values a
    # block) and stored dequantized by the standard/decomposed flavours, packed by the genai one.
    weights_int4: bool = False
    int4_block: int = 32
    # The Hugging Face Optimum convention's mask: an ``attention_mask`` input [batch, total_seq]
    # (1 = attend) expanded as transformers does (``masking_utils``: causal AND padding, no other
    # escape) into an additive 0 / finfo(dtype).min bias on the scores before the softmax.
    attention_mask: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "float16"):
            raise ValueError(f"{self.name}: dtype must be float32 or float16, got {self.dtype!r}")
        if self.flavour not in ("standard", "decomposed", "genai"):
            raise ValueError(f"{self.name}: flavour must be standard, decomposed or genai, got {self.flavour!r}")
        if self.flavour == "genai" and (not self.weights_int4 or self.kv_capacity or self.near_tie):
            raise ValueError(f"{self.name}: the genai flavour has int4 weights, a growing cache and no near-tie")
        if self.attention_mask and (self.flavour == "genai" or self.kv_capacity):
            raise ValueError(f"{self.name}: an attention_mask input is built for the standard and decomposed "
                             "flavours with a growing cache")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.name}: n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"{self.name}: head_dim {self.head_dim} must be even (rotary halves)")
        if self.vocab != 256:
            raise ValueError(f"{self.name}: the models are byte-level, vocab must be 256")

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


def spec_dict(spec: ModelSpec) -> dict[str, Any]:
    """The spec as plain JSON-able data (the manifest's ``spec`` and the model's doc_string).
    Optional fields left at None are omitted, so adding one does not change existing models."""
    d = dataclasses.asdict(spec)
    if d.get("kv_capacity") is None:
        d.pop("kv_capacity", None)
    if not d.get("weights_int4"):
        d.pop("weights_int4", None)
        d.pop("int4_block", None)
    if not d.get("attention_mask"):
        d.pop("attention_mask", None)
    return d


_TINY = ModelSpec(name="tiny-fp32-standard")

# The planted near-tie: found by ``build`` on tiny-fp32-standard's weights (float64 forward), then
# recorded here. Margin 2e-4: well below float16 resolution at the logit scale (a few units: ulp
# ~2e-3 to 4e-3), well above float32 error (~1e-6).
NEAR_TIE = NearTie(prompt=PROMPT, position=len(PROMPT.encode("utf-8")) - 1, top1=207, top2=185, margin=2e-4)

_SMALL = ModelSpec(name="small-fp32-standard", n_layers=4, d_model=128, n_heads=8, n_kv_heads=2, head_dim=16, d_ff=256)

VARIANTS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        _TINY,
        dataclasses.replace(_TINY, name="tiny-fp32-decomposed", flavour="decomposed"),
        dataclasses.replace(_TINY, name="tiny-fp16-standard", dtype="float16"),
        dataclasses.replace(_TINY, name="tiny-fp16-decomposed", dtype="float16", flavour="decomposed"),
        _SMALL,
        dataclasses.replace(_TINY, name="tiny-neartie-fp32-standard", near_tie=NEAR_TIE),
        dataclasses.replace(_TINY, name="tiny-fp32-standard-kv64", kv_capacity=64),
        dataclasses.replace(_TINY, name="tiny-fp32-decomposed-kv64", flavour="decomposed", kv_capacity=64),
        # the largest model with a fixed-capacity cache: its decode step is one captured graph
        dataclasses.replace(_SMALL, name="small-fp32-standard-kv64", kv_capacity=64),
        # ONNX Runtime GenAI style: GroupQueryAttention, SkipSimplifiedLayerNormalization, MatMulNBits int4
        dataclasses.replace(_TINY, name="tiny-int4-genai", flavour="genai", weights_int4=True),
        # Hugging Face Optimum style: an attention_mask input whose every key reaches the softmax
        # (Add of the 0 / finfo.min bias before Softmax; the Attention op's float attn_mask)
        dataclasses.replace(_TINY, name="tiny-fp32-decomposed-mask", flavour="decomposed", attention_mask=True),
        dataclasses.replace(_TINY, name="tiny-fp16-standard-mask", dtype="float16", attention_mask=True),
    )
}

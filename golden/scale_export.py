"""Random-init decoders at the sizes runtime teams ship (135M to 8B parameters), written straight
to a model folder as ONNX Runtime GenAI's builder lays one out: ``model.onnx`` (the graph, weights
referenced), ``model.onnx.data`` (the weights, external data) and ``genai_config.json``.

The graph is ``llama_export.build_llama_onnx``'s GenAI convention (GroupQueryAttention,
SkipSimplifiedLayerNormalization, MatMulNBits for int4) with Qwen2.5's or Llama 3's shapes
(``SIZES``). Weights are drawn one at a time when the graph needs them (float32 uniform values of
the standard deviations ``llama_export.random_llama_weights`` gives, from a generator seeded per
weight; int4 projections as random 4-bit values, ``LazyInt4``), cast,
written to the data file and dropped: building an 8B model holds its largest weight, never all of
them, and no proto ever holds the weights (protobuf cannot serialise one past 2 GiB).

``write_model(folder, "1.5b", dtype="float32")``; ``python -m lockstep.golden.scale_export FOLDER
--size 1.5b [--dtype float16] [--int4]``. Deterministic: the same arguments give the same bytes.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import onnx
from onnx import TensorProto

from .int4 import Int4Weight
from .llama_export import LlamaConfig, _shapes, build_llama_onnx, projection_names

__all__ = ["SIZES", "ExternalData", "LazyWeights", "LazyInt4", "write_model", "genai_config", "parameters"]

# Qwen2.5's shapes (0.5B, 1.5B, 3B: tied embeddings, 2 KV heads), Llama 3's 8B, SmolLM2's 135M
SIZES: dict[str, LlamaConfig] = {
    "135m": LlamaConfig(n_layers=30, hidden=576, n_heads=9, n_kv_heads=3, head_dim=64, d_ff=1536, vocab=49152,
                        max_positions=4096),
    "0.5b": LlamaConfig(n_layers=24, hidden=896, n_heads=14, n_kv_heads=2, head_dim=64, d_ff=4864, vocab=151936,
                        rope_theta=1e6, rms_eps=1e-6, max_positions=4096),
    "1.5b": LlamaConfig(n_layers=28, hidden=1536, n_heads=12, n_kv_heads=2, head_dim=128, d_ff=8960, vocab=151936,
                        rope_theta=1e6, rms_eps=1e-6, max_positions=4096),
    "3b": LlamaConfig(n_layers=36, hidden=2048, n_heads=16, n_kv_heads=2, head_dim=128, d_ff=11008, vocab=151936,
                      rope_theta=1e6, rms_eps=1e-6, max_positions=4096),
    "8b": LlamaConfig(n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, head_dim=128, d_ff=14336, vocab=128256,
                      rope_theta=5e5, rms_eps=1e-5, tie_embeddings=False, max_positions=4096),
}
DATA_FILE = "model.onnx.data"
ALIGN = 4096  # each tensor starts on a page: a memory map of one tensor is a map of its own pages


def parameters(cfg: LlamaConfig) -> int:
    """The model's parameter count (the weights ``_shapes`` lists)."""
    return int(sum(int(np.prod(s)) for s in _shapes(cfg).values()))


class ExternalData:
    """The data file a model's large initializers are written to as they are made (``Graph``'s
    sink): ``tensor(name, array)`` appends the array's bytes (page aligned) and returns the
    TensorProto that references them (location relative to the model's folder)."""

    threshold = 1024  # bytes: smaller initializers stay in the proto, as the builder leaves them

    def __init__(self, path: Path):
        self.path = Path(path)
        self._f = open(self.path, "wb")

    def tensor(self, name: str, a: np.ndarray) -> TensorProto:
        a = np.ascontiguousarray(a)
        pad = -self._f.tell() % ALIGN
        if pad:
            self._f.write(b"\0" * pad)
        offset = self._f.tell()
        self._f.write(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())
        t = TensorProto(name=name, data_type=onnx.helper.np_dtype_to_tensor_dtype(a.dtype), dims=a.shape)
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", self.path.name), ("offset", str(offset)), ("length", str(a.nbytes))):
            t.external_data.add(key=k, value=v)
        return t

    def close(self) -> None:
        self._f.close()


def _seed(seed: int, name: str) -> np.random.Generator:
    """A generator per weight: a weight's values depend on the seed and its name only."""
    return np.random.default_rng([seed, *name.encode()])


def _scale(cfg: LlamaConfig, name: str, shape: tuple[int, ...]) -> float:
    """A matrix's standard deviation, as ``llama_export.random_llama_weights`` sets it: 3/sqrt(hidden)
    for the embedding and LM head, 1/sqrt(fan_in) for a projection (q and k twice that)."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 3.0 / np.sqrt(cfg.hidden)
    return (2.0 if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0) / np.sqrt(shape[1])


class _Lazy:
    """One weight, drawn when read (``np.asarray``); its ``shape`` known without drawing it."""

    def __init__(self, cfg: LlamaConfig, name: str, shape: tuple[int, ...], seed: int):
        self.cfg, self.name, self.shape, self.seed = cfg, name, shape, seed

    def draw(self) -> np.ndarray:
        """Uniform values of unit variance times the weight's scale (uniform, not normal: numpy draws
        them three times as fast, which an 8B model's build on the lent GPU machine needs)."""
        rng, shape = _seed(self.seed, self.name), self.shape
        w = rng.random(shape, dtype=np.float32)
        w -= np.float32(0.5)
        w *= np.float32(np.sqrt(12.0) * (0.1 if len(shape) == 1 else _scale(self.cfg, self.name, shape)))
        if len(shape) == 1:
            w += np.float32(1.0)
        return w

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        w = self.draw()
        return w if dtype is None else w.astype(dtype, copy=False)


class LazyWeights(Mapping):
    """HF-named weights of ``cfg`` (``llama_export._shapes``), each drawn when read, never kept."""

    def __init__(self, cfg: LlamaConfig, seed: int = 0, skip: frozenset[str] = frozenset()):
        self.cfg, self.seed = cfg, seed
        self._shapes = {k: v for k, v in _shapes(cfg).items() if k not in skip}

    def __getitem__(self, name: str) -> _Lazy:
        return _Lazy(self.cfg, name, self._shapes[name], self.seed)

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


class LazyInt4(Mapping):
    """Every projection as random 4-bit weights in MatMulNBits' layout (blocks of 32, zero point 8),
    drawn when read: uniform 4-bit values, a scale per block around the projection's standard
    deviation / 4.64 (the root mean square of q - 8 over 0..15). Drawn, not quantized from a float
    weight: a quantizer takes minutes over an 8B model's projections, and a random model has no
    float weight to be faithful to."""

    def __init__(self, cfg: LlamaConfig, seed: int = 0, dtype: str = "float32", block: int = 32):
        self.cfg, self.seed, self.dtype, self.block = cfg, seed, dtype, block
        self._names = set(projection_names(cfg))
        self._shapes = _shapes(cfg)

    def __getitem__(self, name: str) -> Int4Weight:
        if name not in self._names:
            raise KeyError(name)
        n, k = self._shapes[name]
        rng, nb = _seed(self.seed, "int4:" + name), k // self.block
        packed = np.frombuffer(rng.bytes(n * k // 2), np.uint8).reshape(n, nb, self.block // 2)
        scales = rng.random(n * nb, dtype=np.float32)
        scales *= np.float32(0.5)
        scales += np.float32(0.75)
        scales *= np.float32(_scale(self.cfg, name, (n, k)) / np.sqrt(21.5))
        return Int4Weight(packed, scales.astype(self.dtype), None, self.block)

    def __iter__(self) -> Iterator[str]:
        return iter(projection_names(self.cfg))

    def __len__(self) -> int:
        return len(self._names)


def genai_config(cfg: LlamaConfig, context: int) -> dict[str, Any]:
    """``genai_config.json`` as the builder writes it for a CPU export (the search's ``max_length``
    and the model's ``context_length`` both ``context``; KV buffer shared between past and present)."""
    return {
        "model": {
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "type": "llama", "vocab_size": cfg.vocab,
            "context_length": context,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": "model.onnx", "head_size": cfg.head_dim, "hidden_size": cfg.hidden,
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                           "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
                "num_attention_heads": cfg.n_heads, "num_hidden_layers": cfg.n_layers,
                "num_key_value_heads": cfg.n_kv_heads,
            },
        },
        "search": {"do_sample": False, "early_stopping": True, "max_length": context, "min_length": 0,
                   "num_beams": 1, "num_return_sequences": 1, "past_present_share_buffer": True,
                   "repetition_penalty": 1.0, "temperature": 1.0, "top_k": 1, "top_p": 1.0},
    }


def write_model(folder: str | Path, size: str | LlamaConfig, *, dtype: str = "float32", int4: bool = False,
                seed: int = 0, context: int | None = None) -> Path:
    """Write the model folder (``model.onnx``, ``model.onnx.data``, ``genai_config.json``); returns
    the ``model.onnx`` path. ``int4``: every projection MatMulNBits (random 4-bit weights, ``LazyInt4``)."""
    cfg = SIZES[size] if isinstance(size, str) else size
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sink = ExternalData(folder / DATA_FILE)
    try:
        model = build_llama_onnx(cfg, LazyWeights(cfg, seed, frozenset(projection_names(cfg)) if int4 else frozenset()),
                                 convention="genai", dtype=dtype, int4=LazyInt4(cfg, seed, dtype) if int4 else None,
                                 name=f"random-{size if isinstance(size, str) else 'llama'}", external=sink)
    finally:
        sink.close()
    path = folder / "model.onnx"
    onnx.save_model(model, str(path))  # the graph and small constants only: the weights are in DATA_FILE
    (folder / "genai_config.json").write_text(json.dumps(genai_config(cfg, context or cfg.max_positions), indent=4) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lockstep.golden.scale_export", description=__doc__.split("\n\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--size", choices=sorted(SIZES), required=True)
    ap.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    ap.add_argument("--int4", action="store_true", help="every projection as MatMulNBits (4-bit)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--context", type=int, help="genai_config's context_length and max_length (default 4096)")
    a = ap.parse_args(argv)
    path = write_model(a.folder, a.size, dtype=a.dtype, int4=a.int4, seed=a.seed, context=a.context)
    size = sum(f.stat().st_size for f in path.parent.iterdir())
    print(f"{path}: {a.size} ({parameters(SIZES[a.size]) / 1e9:.2f}B parameters), {a.dtype}"
          f"{', int4' if a.int4 else ''}, {size / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

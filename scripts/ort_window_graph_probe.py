"""Does ONNX Runtime's CUDA graph replay a window-sized GroupQueryAttention cache as it runs eagerly?

Measured on the H200 (docs/gpu-verification.md, issue 30): ORT CUDA graphs on the builder's Gemma 2/3
``-e cuda`` graphs (``sliding_window_cache=1`` on the local layers) leave the eager decode at the
first replay, while the builder's Llama graphs (no window cache) replay byte-identical. This script
separates the causes, printing one table per part:

  A. one GroupQueryAttention node (fp16, ``sliding_window_cache=1``, C = W = 8, rotary), its
     window cache bound in place, one-token steps after a 9-token prefill: eager vs CUDA graph
     (``enable_cuda_graph=1``, inputs at fixed addresses updated in place), max |difference| of the
     output and of the present's resident rows per step; the same with ``sliding_window_cache=0`` and
     a full buffer as the control.
  B. lockstep's ort-cuda decode of genai/gemma2-fp16-cuda, capture off and on (OrtDecoder).
  C. ONNX Runtime GenAI's own Generator on the same export, enable_cuda_graph 0 and 1 (ort-genai-cuda).

Needs onnxruntime-gpu (the CUDA provider); parts B and C need the committed exports, C
onnxruntime-genai-cuda. ``python scripts/ort_window_graph_probe.py [--steps N]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
EXPORT = ROOT / "golden" / "exports" / "genai" / "gemma2-fp16-cuda" / "model.onnx"


def _node_model(window_cache: bool, C: int, nq: int, nkv: int, D: int, rows: int):
    from onnx import TensorProto as TP, helper

    attrs = dict(num_heads=nq, kv_num_heads=nkv, do_rotary=1, local_window_size=8 if window_cache else -1)
    if window_cache:
        attrs["sliding_window_cache"] = 1
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "sk", "tsl", "cos", "sin"],
                            ["out", "present_k", "present_v"], domain="com.microsoft", **attrs)
    h = TP.FLOAT16
    ins = [helper.make_tensor_value_info("q", h, [1, "S", nq * D]), helper.make_tensor_value_info("k", h, [1, "S", nkv * D]),
           helper.make_tensor_value_info("v", h, [1, "S", nkv * D]),
           helper.make_tensor_value_info("pk", h, [1, nkv, C, D]), helper.make_tensor_value_info("pv", h, [1, nkv, C, D]),
           helper.make_tensor_value_info("sk", TP.INT32, [1]), helper.make_tensor_value_info("tsl", TP.INT32, []),
           helper.make_tensor_value_info("cos", h, [rows, D // 2]), helper.make_tensor_value_info("sin", h, [rows, D // 2])]
    outs = [helper.make_tensor_value_info("out", h, [1, "S", nq * D]),
            helper.make_tensor_value_info("present_k", h, [1, nkv, C, D]),
            helper.make_tensor_value_info("present_v", h, [1, nkv, C, D])]
    g = helper.make_graph([node], "gqa", ins, outs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=9).SerializeToString()


def part_a(steps: int) -> None:
    import onnxruntime as ort

    nq, nkv, D, rows, prompt = 4, 2, 16, 128, 9
    rng = np.random.default_rng(0)
    ang = rng.uniform(0, 2 * np.pi, (rows, D // 2))
    cos, sin = np.cos(ang).astype(np.float16), np.sin(ang).astype(np.float16)
    total = prompt + steps
    q = rng.standard_normal((1, total, nq * D)).astype(np.float16)
    k = rng.standard_normal((1, total, nkv * D)).astype(np.float16)
    v = rng.standard_normal((1, total, nkv * D)).astype(np.float16)
    print("A. one GroupQueryAttention node, fp16, one-token steps after a 9-token prefill")
    print(f"{'cache':<26} {'step':>4} {'max|out diff|':>14} {'max|present diff|':>18}")
    for window_cache, C in ((True, 8), (False, rows)):
        model = _node_model(window_cache, C, nq, nkv, D, rows)
        results = {}
        for graph in (False, True):
            so = ort.SessionOptions()
            prov = [("CUDAExecutionProvider", {"enable_cuda_graph": "1" if graph else "0"})]
            sess = ort.InferenceSession(model, so, providers=prov)
            new = ort.OrtValue.ortvalue_from_numpy
            pk, pv = new(np.zeros((1, nkv, C, D), np.float16), "cuda", 0), new(np.zeros((1, nkv, C, D), np.float16), "cuda", 0)
            tables = {"cos": new(cos, "cuda", 0), "sin": new(sin, "cuda", 0)}
            fixed = {"q": new(q[:, :1].copy(), "cuda", 0), "k": new(k[:, :1].copy(), "cuda", 0),
                     "v": new(v[:, :1].copy(), "cuda", 0), "sk": new(np.array([0], np.int32), "cuda", 0)}
            out1 = new(np.zeros((1, 1, nq * D), np.float16), "cuda", 0)
            tsl = np.array(rows, np.int32)  # the shared buffer's mask length, as the builder's graph computes it
            got = []
            for step in range(steps + 1):
                b = sess.io_binding()
                if step == 0:
                    for name, a in (("q", q[:, :prompt]), ("k", k[:, :prompt]), ("v", v[:, :prompt])):
                        b.bind_cpu_input(name, np.ascontiguousarray(a))
                    b.bind_cpu_input("sk", np.array([prompt - 1], np.int32))
                    b.bind_output("out", "cpu")
                    t = prompt
                else:
                    t = prompt + step
                    pos = t - 1
                    for name, a in (("q", q), ("k", k), ("v", v)):
                        fixed[name].update_inplace(np.ascontiguousarray(a[:, pos:pos + 1]))
                        b.bind_ortvalue_input(name, fixed[name])
                    fixed["sk"].update_inplace(np.array([t - 1], np.int32))
                    b.bind_ortvalue_input("sk", fixed["sk"])
                    b.bind_ortvalue_output("out", out1)
                b.bind_cpu_input("tsl", tsl)
                for name, val in tables.items():
                    b.bind_ortvalue_input(name, val)
                b.bind_ortvalue_input("pk", pk)
                b.bind_ortvalue_input("pv", pv)
                b.bind_ortvalue_output("present_k", pk)  # in place (the CUDA provider requires it for a window cache)
                b.bind_ortvalue_output("present_v", pv)
                opts = ort.RunOptions()
                opts.add_run_config_entry("gpu_graph_id", "1" if (graph and step > 0) else "-1")
                sess.run_with_iobinding(b, opts)
                o = out1.numpy() if step else b.get_outputs()[0].numpy()
                keep = min(t, C)
                got.append((o[:, -1].astype(np.float32), pk.numpy()[:, :, :keep].astype(np.float32)))
            results[graph] = got
        label = "window C=W=8" if window_cache else f"full buffer C={rows}"
        for step in range(steps + 1):
            (oe, pe), (og, pg) = results[False][step], results[True][step]
            print(f"{label:<26} {step:>4} {float(np.abs(oe - og).max()):>14.6g} {float(np.abs(pe - pg).max()):>18.6g}")


def part_b(steps: int) -> None:
    from lockstep.decoder_io import DecoderIO
    from lockstep.decoding import first_divergence, greedy, open_session
    from lockstep.engines.registry import load_engine
    from lockstep.genai_config import card_for
    from lockstep.loading import load_model

    model, _ = load_model(EXPORT)
    io = DecoderIO.of(model, card_for(EXPORT))
    eng = load_engine("ort-cuda")
    prompt = list(range(5, 14))
    off = greedy(open_session(eng, model, capture=False, io=io), prompt, steps)
    on_session = open_session(eng, model, capture=True, io=io)
    on = greedy(on_session, prompt, steps)
    print("B. lockstep ort-cuda, genai/gemma2-fp16-cuda: capture off", off.tokens)
    print("                                              capture on ", on.tokens, "graph runs", on_session.graph_runs)
    print("   first divergence:", first_divergence(on, off))


def part_c(steps: int) -> None:
    from lockstep.decoder_io import DecoderIO
    from lockstep.decoding import first_divergence, greedy, open_session
    from lockstep.engines.registry import load_engine
    from lockstep.genai_config import card_for
    from lockstep.model_source import mark_source
    from lockstep.loading import load_model

    model, _ = load_model(EXPORT)
    mark_source(model, EXPORT)
    io = DecoderIO.of(model, card_for(EXPORT))
    eng = load_engine("ort-genai-cuda")
    ok, why = eng.available()
    if not ok:
        print("C. ort-genai-cuda unavailable:", why)
        return
    prompt = list(range(5, 14))
    off = greedy(open_session(eng, model, capture=False, io=io), prompt, steps)
    on = greedy(open_session(eng, model, capture=True, io=io), prompt, steps)
    print("C. ORT GenAI, genai/gemma2-fp16-cuda: enable_cuda_graph 0", off.tokens)
    print("                                       enable_cuda_graph 1", on.tokens)
    print("   first divergence:", first_divergence(on, off))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args(argv)
    for part in (part_a, part_b, part_c):
        try:
            part(args.steps)
        except Exception as exc:  # noqa: BLE001 - a probe: say what failed and go on
            print(f"{part.__name__}: {type(exc).__name__}: {' '.join(str(exc).split())[:400]}")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

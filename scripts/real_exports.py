#!/usr/bin/env python3
"""Tiny random-init LLMs exported by the two real exporters, with a transformers reference.

Usage:
    python scripts/real_exports.py --out golden/exports [--venvs DIR] [--only ARCH[,ARCH]]
        [--skip-setup] [--keep-going] [--max-mb 20] [--work DIR]

What it does (golden/exports/README.md has the layout and the results):
  1. makes (or reuses) two private virtual environments under --venvs
     (default ~/.cache/lockstep/exporters/): ``optimum`` (optimum-onnx + the transformers it
     supports + onnxruntime) and ``genai`` (onnxruntime-genai's model builder + transformers 5),
     each with the local CPU build of torch 2.13.0 installed first and pinned as a constraint;
  2. builds tiny random-init causal LMs from configs written here (no download; seeded), with a
     byte-level BPE tokenizer trained here on the paragraph below, saved with ``save_pretrained``;
  3. exports them with ``python -m onnxruntime_genai.models.builder`` and ``optimum-cli export
     onnx``; an optional variant that an exporter refuses is recorded under ``refused``;
  4. computes the reference in each venv with transformers (fp32, eager attention): greedy
     ``generate`` of 24 tokens and the prompt's last-position logits (``reference/*.npy``);
  5. runs each fp32 export in onnxruntime (CPU) with a plain greedy loop and records whether its
     ids equal transformers' (``ort_cpu_matches_transformers``);
  6. writes ``manifest.json`` (versions, configs, sha256 and size of every file, graph summary:
     opsets, ops by domain, I/O, contrib-op attributes) and prints the total size; fails over
     --max-mb.

The calling interpreter only needs the standard library: torch, transformers, optimum and
onnxruntime live in the venvs, which run this same file in ``--worker`` mode.
Prints one line per step, then the matrix, the ORT agreement and the total size.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

# ----------------------------------------------------------------------------- pins
TORCH = "torch==2.13.0"  # the local CPU wheel (any other spec pulls a multi-GB CUDA build)

# Resolved on 2026-11 with this machine's index; what pip picked, frozen so that a
# regeneration is reproducible.  Notes:
#  - optimum-onnx 0.1.0 (latest) requires optimum~=2.1.0 and transformers<4.58 -> 4.57.6.
#  - transformers 5.25.0 (latest) requires kernels>=0.19.1, which the index does not have
#    (latest 0.17.2), so the genai venv takes 5.24.0, the newest that installs.
PINS = {
    "optimum": [
        TORCH,
        "optimum-onnx[onnxruntime]==0.1.0",
        "optimum==2.1.0",
        "accelerate==1.16.0",  # optional, but without it Optimum skips its tied-weight deduplication
        "psutil==7.2.2",
        "transformers==4.57.6",
        "tokenizers==0.22.2",
        "huggingface_hub==0.36.2",
        "onnx==1.23.2",
        "onnxruntime==1.32.0",
        "numpy==2.4.6",
        "safetensors==0.8.0",
        "protobuf==7.36.2",
        "ml_dtypes==0.7.0",
    ],
    "genai": [
        TORCH,
        "onnxruntime-genai==0.18.0",
        "transformers==5.24.0",
        "tokenizers==0.23.3",
        "huggingface_hub==2.4.0",
        "onnx==1.23.2",
        "onnx-ir==1.1.0",
        "onnxruntime==1.32.0",
        "numpy==2.4.6",
        "safetensors==0.8.0",
        "protobuf==7.36.2",
        "ml_dtypes==0.7.0",
        "tqdm==4.70.1",
    ],
}
EXPORTER_DIST = {"optimum": "optimum-onnx", "genai": "onnxruntime-genai"}
VERSION_DISTS = ["torch", "transformers", "tokenizers", "onnx", "onnxruntime", "numpy",
                 "optimum", "optimum-onnx", "onnxruntime-genai", "onnx-ir", "huggingface_hub"]

# ----------------------------------------------------------------------------- models
SEED = 1235  # scanned 1234-1245: the first whose 8 greedy runs all have >= 11 distinct ids and no eos
VOCAB = 320
NEW_TOKENS = 24
INIT_STD = 0.2
PROMPT = "The weather was"  # 9 ids with <s>

# A paragraph of English for the tokenizer (byte-level BPE, vocab = VOCAB).
CORPUS = (
    "The quick brown fox jumps over the lazy dog. A conformance suite runs the same model on "
    "two runtimes and compares what comes out, token by token and logit by logit. When the "
    "numbers disagree, the first place where they part is the most useful thing to know: it "
    "names the layer, the operator and the input that made the difference. Small models are "
    "good for this, because every step can be checked by hand, and a test that takes a second "
    "is a test that people will run. The weather was cold in the morning and warm in the "
    "afternoon, and the river ran quietly under the old stone bridge while the children played "
    "on the bank. She said that the train would leave at seven, but it was late again, and the "
    "passengers waited on the platform with their coffee and their newspapers. There is no "
    "reason to hurry when the answer is already written down; there is every reason to check it."
)

COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
    initializer_range=INIT_STD, rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1,
    eos_token_id=2, use_cache=True,
)

# The Gemma family multiplies its tied embedding by sqrt(hidden): drawn at INIT_STD the residual
# stream is the current token's embedding and greedy copies it forever.  So their embedding is
# drawn smaller and the final norm gets a gain (logits of scale 5-15; Gemma 2's softcaps bite).
TWEAKS = {
    "gemma": {"embed_std": 0.02, "final_norm_weight": 14.0},
    "gemma2": {"embed_std": 0.03, "final_norm_weight": 14.0},
    "gemma3": {"embed_std": 0.01, "final_norm_weight": 14.0},
}

# name -> (config class, model class, config kwargs on top of COMMON)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(tie_word_embeddings=False, rope_theta=10000.0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(tie_word_embeddings=True, rope_theta=1000000.0, use_sliding_window=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(tie_word_embeddings=True, rope_theta=1000000.0, use_sliding_window=False)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(tie_word_embeddings=False, rope_theta=10000.0, original_max_position_embeddings=128,
                  sliding_window=None, head_dim=None)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM",
              dict(tie_word_embeddings=True, rope_theta=10000.0,
                   hidden_activation="gelu_pytorch_tanh")),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(tie_word_embeddings=True, rope_theta=10000.0, sliding_window=8,
                    attn_logit_softcapping=4.0, final_logit_softcapping=8.0,
                    query_pre_attn_scalar=16, hidden_activation="gelu_pytorch_tanh",
                    layer_types=["sliding_attention", "full_attention"])),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(tie_word_embeddings=True, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                    sliding_window=8, query_pre_attn_scalar=16,
                    hidden_activation="gelu_pytorch_tanh",
                    layer_types=["sliding_attention", "full_attention"])),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(tie_word_embeddings=False, rope_theta=10000.0, sliding_window=8)),
}

# Export matrix.  Every architecture: builder fp32/cpu and Optimum fp32.  The full matrix
# (builder fp32/fp16/int4 x cpu/cuda, Optimum fp16 and O2) for FULL_MATRIX only, for size.
FULL_MATRIX = ("llama", "gemma2", "gemma3")
GENAI_ALL = [(p, e) for p in ("fp32", "fp16", "int4") for e in ("cpu", "cuda")]
OPTIMUM_ALL = ["fp32", "fp16", "O2"]
HF_WEIGHTS_MAX = 200 * 1024  # commit model.safetensors only under this size


def genai_matrix(arch):
    return GENAI_ALL if arch in FULL_MATRIX else [("fp32", "cpu")]


def optimum_matrix(arch):
    return OPTIMUM_ALL if arch in FULL_MATRIX else ["fp32"]


# ============================================================================= helpers
def log(msg):
    print(msg, flush=True)


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def files_of(folder):
    out = {}
    for p in sorted(Path(folder).rglob("*")):
        if p.is_file():
            out[p.relative_to(folder).as_posix()] = {"sha256": sha256(p), "size": p.stat().st_size}
    return out


def venv_python(venvs, name):
    return str(Path(venvs) / name / "bin" / "python")


def run_logged(cmd, logfile, env=None, cwd=None):
    """Run cmd, stdout+stderr to logfile; return (rc, text)."""
    with open(logfile, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    return rc, Path(logfile).read_text(errors="replace")


def error_line(text):
    """The most telling line of a failed command's output."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    pat = re.compile(r"(Error|Exception|error:|not supported|only supported|refus|requires)")
    for ln in reversed(lines):
        if pat.search(ln) and not ln.startswith("File "):
            return ln[:400]
    return lines[-1][:400] if lines else "(no output)"


def worker(venvs, name, mode, payload, logfile):
    """Run this file in --worker mode in venv `name`; payload in, JSON out."""
    inp = Path(logfile).with_suffix(".in.json")
    outp = Path(logfile).with_suffix(".out.json")
    inp.write_text(json.dumps(payload))
    if outp.exists():
        outp.unlink()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONHASHSEED="0", CUDA_VISIBLE_DEVICES="")
    rc, text = run_logged([venv_python(venvs, name), os.path.abspath(__file__), "--worker", mode,
                           str(inp), str(outp)], logfile, env=env)
    if rc != 0 or not outp.exists():
        raise RuntimeError(f"worker {mode} in {name} venv failed (rc {rc}): {error_line(text)} [log {logfile}]")
    return json.loads(outp.read_text())


# ============================================================================= setup
def setup_venvs(venvs, skip):
    venvs = Path(venvs)
    venvs.mkdir(parents=True, exist_ok=True)
    for name, pins in PINS.items():
        py = venv_python(venvs, name)
        stamp = venvs / name / "lockstep-pins.txt"
        want = "\n".join(pins) + "\n"
        if Path(py).exists() and stamp.exists() and stamp.read_text() == want:
            log(f"[setup] {name}: reusing {venvs / name}")
            continue
        if skip:
            if Path(py).exists():
                log(f"[setup] {name}: --skip-setup, reusing {venvs / name} (pins not verified)")
                continue
            raise SystemExit(f"error: --skip-setup but no venv at {venvs / name}")
        log(f"[setup] {name}: creating {venvs / name}")
        if not Path(py).exists():
            subprocess.check_call([sys.executable, "-m", "venv", str(venvs / name)])
        cons = venvs / f"{name}-constraints.txt"
        cons.write_text(TORCH + "\n")
        pip = [py, "-m", "pip", "install", "--no-cache-dir", "--disable-pip-version-check", "-q"]
        # torch first, alone (the local CPU wheel), then everything with torch pinned again
        subprocess.check_call(pip + [TORCH])
        subprocess.check_call(pip + ["-c", str(cons)] + pins)
        stamp.write_text(want)


def venv_versions(venvs, name, workdir):
    return worker(venvs, name, "versions", {}, str(Path(workdir) / f"versions-{name}.log"))


# ============================================================================= exports
# onnxruntime-genai 0.18.0's builder cannot read a config whose rope_parameters are keyed by
# layer type, which is how transformers 5 always loads Gemma 3 (text) configs, also the legacy
# rope_theta + rope_local_base_freq form: Model.make_rope_init raises KeyError: 'rope_type' (and
# Gemma3Model then reads config.rope_local_base_freq, which transformers 5 no longer sets).  Such a
# failure is recorded under `refused` and the export is retried through this shim, which runs the
# unmodified builder module after flattening that one config object back to the 4.x form
# (rope_parameters = the full-attention entry, rope_theta, rope_local_base_freq).
SHIM_TRIGGER = "KeyError: 'rope_type'"
SHIM_NOTE = ("builder run through scripts/real_exports.py's genai_shim: AutoConfig's nested "
             "rope_parameters {full_attention, sliding_attention} flattened to rope_parameters=full_attention, "
             "rope_theta=full theta, rope_local_base_freq=sliding theta (builder 0.18.0 reads only that form)")


def export_genai(venvs, hf_dir, out_dir, precision, ep, cache, logfile, shim=False):
    args = ["-i", str(hf_dir), "-o", str(out_dir), "-p", precision, "-e", ep, "-c", str(cache)]
    if shim:
        inp = Path(logfile).with_suffix(".in.json")
        inp.write_text(json.dumps({"argv": args}))
        cmd = [venv_python(venvs, "genai"), os.path.abspath(__file__), "--worker", "genai_shim", str(inp),
               str(Path(logfile).with_suffix(".out.json"))]
    else:
        cmd = [venv_python(venvs, "genai"), "-m", "onnxruntime_genai.models.builder", *args]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    rc, text = run_logged(cmd, logfile, env=env)
    return rc, text, cmd


def export_optimum(venvs, hf_dir, out_dir, variant, cache, logfile):
    cli = str(Path(venvs) / "optimum" / "bin" / "optimum-cli")
    cmd = [cli, "export", "onnx", "--model", str(hf_dir), "--task", "text-generation-with-past",
           "--cache_dir", str(cache)]
    if variant == "fp16":
        cmd += ["--dtype", "fp16"]
    elif variant == "O2":
        cmd += ["--optimize", "O2"]
    cmd.append(str(out_dir))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    rc, text = run_logged(cmd, logfile, env=env)
    return rc, text, cmd


def rel_cmd(cmd, out, work, venvs):
    s = " ".join(cmd)
    for a, b in ((str(work), "$WORK"), (str(out), "$OUT"), (str(venvs), "$VENVS")):
        s = s.replace(a, b)
    return s


# ============================================================================= main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="golden/exports")
    ap.add_argument("--venvs", default=str(Path.home() / ".cache/lockstep/exporters"))
    ap.add_argument("--work", default=None, help="scratch folder (default VENVS/work)")
    ap.add_argument("--only", default=None, help="ARCH[,ARCH] (others keep their manifest entries)")
    ap.add_argument("--skip-setup", action="store_true")
    ap.add_argument("--keep-going", action="store_true")
    ap.add_argument("--max-mb", type=float, default=20.0)
    ap.add_argument("--worker", nargs=3, metavar=("MODE", "IN", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return run_worker(*args.worker)

    t0 = time.time()
    out = Path(args.out).resolve()
    venvs = Path(args.venvs).expanduser().resolve()
    work = Path(args.work or venvs / "work").resolve()
    archs = list(ARCHS)
    if args.only:
        archs = [a.strip() for a in args.only.split(",") if a.strip()]
        bad = [a for a in archs if a not in ARCHS]
        if bad:
            raise SystemExit(f"error: unknown architecture(s) {bad}; known: {list(ARCHS)}")
    setup_venvs(venvs, args.skip_setup)
    if work.exists():
        shutil.rmtree(work)
    (work / "logs").mkdir(parents=True)
    versions = {n: venv_versions(venvs, n, work / "logs") for n in PINS}
    for n, v in versions.items():
        log(f"[versions] {n}: " + ", ".join(f"{k} {v[k]}" for k in sorted(v) if v[k]))

    # ---- 2/3: HF sources (built once, in the optimum venv: its older transformers writes the
    # config format both transformers versions read)
    hf_src = work / "hf"
    res = worker(venvs, "optimum", "build",
                 {"archs": archs, "dst": str(hf_src)}, str(work / "logs" / "build.log"))
    for a in archs:
        log(f"[build] {a}: {res[a]['params']} parameters, weights {res[a]['weights_size']} B")

    # ---- 4: reference in each venv
    refs = {}
    for n in PINS:
        refs[n] = worker(venvs, n, "reference", {"archs": archs, "src": str(hf_src),
                                                  "dst": str(work / "reference" / n),
                                                  "compare": str(work / "reference" / "optimum")},
                         str(work / "logs" / f"reference-{n}.log"))
        for a in archs:
            r = refs[n][a]
            log(f"[reference] {n} {a}: ids {r['greedy_ids']} (distinct {len(set(r['greedy_ids']))},"
                f" generate==manual {r['generate_matches_manual']})")

    # ---- outputs: clear this run's folders
    out.mkdir(parents=True, exist_ok=True)
    for a in archs:
        for p in [out / "hf" / a, *(out / "genai").glob(f"{a}-*"), *(out / "optimum").glob(f"{a}-*"),
                  *(out / "reference").glob(f"{a}.*")]:
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()

    arch_entries = {}
    for a in archs:
        dst = out / "hf" / a
        dst.mkdir(parents=True)
        wsize = (hf_src / a / "model.safetensors").stat().st_size
        for f in sorted((hf_src / a).iterdir()):
            if f.name == "model.safetensors" and wsize > HF_WEIGHTS_MAX:
                continue
            shutil.copy2(f, dst / f.name)
        (out / "reference").mkdir(exist_ok=True)
        entry = {"hf_dir": f"hf/{a}", "config": res[a]["config"], "params": res[a]["params"],
                 "init": {"seed": SEED, "std": INIT_STD, "bias_std": INIT_STD, "norm_noise_std": 0.1,
                          **res[a]["tweaks"]},
                 "weights": {"file": "model.safetensors", "sha256": sha256(hf_src / a / "model.safetensors"),
                             "size": wsize, "committed": wsize <= HF_WEIGHTS_MAX},
                 "hf_files": files_of(dst), "reference": {}}
        for n in PINS:
            r = refs[n][a]
            tv = versions[n]["transformers"]
            name = f"{a}.transformers-{tv}.npy"
            shutil.copy2(r["logits_path"], out / "reference" / name)
            entry["reference"][n] = {
                "transformers": tv, "torch": versions[n]["torch"],
                "greedy_ids": r["greedy_ids"], "generate_matches_manual": r["generate_matches_manual"],
                "greedy_ids_sdpa": r["greedy_ids_sdpa"], "sdpa_logits_max_abs_diff": r["sdpa_logits_max_abs_diff"],
                "logits_file": f"reference/{name}", "logits_sha256": sha256(out / "reference" / name),
                "logits_absmax": r["logits_absmax"], "prompt_ids": r["prompt_ids"],
            }
        ro, rg = entry["reference"]["optimum"], entry["reference"]["genai"]
        entry["references_agree"] = {"ids": ro["greedy_ids"] == rg["greedy_ids"],
                                     "logits_max_abs_diff": refs["genai"][a].get("logits_max_abs_diff_vs_compare")}
        arch_entries[a] = entry

    # ---- 4: exports
    exports, refused, failed = [], [], []
    ex_work = work / "exports"
    for a in archs:
        hf_dir = hf_src / a
        plan = [("genai", f"{p}-{e}", p, e) for p, e in genai_matrix(a)]
        plan += [("optimum", v, v if v != "O2" else "fp32", "cpu") for v in optimum_matrix(a)]
        for exporter, variant, precision, ep in plan:
            tag = f"{a}-{variant}"
            tmp_out = ex_work / exporter / tag
            logf = work / "logs" / f"{exporter}-{tag}.log"
            cache = work / "cache" / exporter / tag
            ts = time.time()
            shim_note = None
            if exporter == "genai":
                rc, text, cmd = export_genai(venvs, hf_dir, tmp_out, precision, ep, cache, logf)
                if rc != 0 and SHIM_TRIGGER in text:
                    refused.append({"architecture": a, "exporter": exporter, "variant": variant,
                                    "precision": precision, "ep": ep, "command": rel_cmd(cmd, out, work, venvs),
                                    "rc": rc, "message": error_line(text),
                                    "then": "retried through the compat shim (see export's compat_shim)"})
                    log(f"[export] {exporter} {tag}: refused as is ({error_line(text)}); retrying through the shim")
                    if tmp_out.exists():
                        shutil.rmtree(tmp_out)
                    logf = logf.with_name(logf.stem + "-shim.log")
                    rc, text, cmd = export_genai(venvs, hf_dir, tmp_out, precision, ep, cache, logf, shim=True)
                    shim_note = SHIM_NOTE
            else:
                rc, text, cmd = export_optimum(venvs, hf_dir, tmp_out, variant, cache, logf)
            dt = time.time() - ts
            mandatory = variant in ("fp32-cpu", "fp32")
            has_model = (tmp_out / "model.onnx").exists()
            if rc != 0 or not has_model:
                msg = error_line(text) if rc != 0 else "exited 0 but wrote no model.onnx"
                rec = {"architecture": a, "exporter": exporter, "variant": variant, "precision": precision,
                       "ep": ep, "command": rel_cmd(cmd, out, work, venvs), "rc": rc, "message": msg}
                if mandatory:
                    failed.append(rec)
                    log(f"[export] {exporter} {tag}: FAILED ({dt:.0f}s): {msg}")
                    if not args.keep_going:
                        print(f"error: {exporter} export {tag} failed: {msg} (log {logf})", file=sys.stderr)
                        return 1
                else:
                    refused.append(rec)
                    log(f"[export] {exporter} {tag}: refused ({dt:.0f}s): {msg}")
                continue
            dest = out / exporter / tag
            shutil.copytree(tmp_out, dest)
            copied = []
            for tf in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                if not (dest / tf).exists() and (hf_dir / tf).exists():
                    shutil.copy2(hf_dir / tf, dest / tf)
                    copied.append(tf)
            validation = [ln.strip() for ln in text.splitlines()
                          if re.search(r"max diff|not within the set tolerance|All good", ln)]
            exports.append({"compat_shim": shim_note, "exporter_messages": validation, "architecture": a,
                            "exporter": exporter, "variant": variant,
                            "precision": precision, "ep": ep, "path": f"{exporter}/{tag}",
                            "command": rel_cmd(cmd, out, work, venvs), "tokenizer_files_copied_by_script": copied})
            log(f"[export] {exporter} {tag}: ok ({dt:.0f}s)" + (f", copied {copied}" if copied else ""))

    # ---- 5/6: graph summaries and ORT CPU checks (one worker per venv)
    for n in PINS:
        mine = [e for e in exports if e["exporter"] == n]
        if not mine:
            continue
        jobs = []
        for e in mine:
            ref = arch_entries[e["architecture"]]["reference"][n]
            cfg = arch_entries[e["architecture"]]["config"]
            jobs.append({"path": str(out / e["path"]), "check": True, "expect_sdpa": ref["greedy_ids_sdpa"],
                         "prompt_ids": ref["prompt_ids"], "expect": ref["greedy_ids"],
                         "ref_logits": str(out / ref["logits_file"]),
                         "kv_heads": cfg["num_key_value_heads"], "window": cfg.get("sliding_window") or 0,
                         "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
                         "genai_runtime": n == "genai" and e["ep"] == "cpu" and e["precision"] in ("fp32", "fp16")})
        info = worker(venvs, n, "inspect", {"jobs": jobs, "new_tokens": NEW_TOKENS},
                      str(work / "logs" / f"inspect-{n}.log"))
        for e, j in zip(mine, jobs):
            e.update(info[j["path"]])
            if "ort_cpu_matches_transformers" in e:
                if e["ort_cpu_ran"]:
                    extra = (f"first diff at {e['ort_cpu_first_diff']}, "
                             f"prompt logits max|d| {e['ort_cpu_prompt_logits_max_abs_diff']:.2g}, "
                             f"matches sdpa {e['ort_cpu_matches_transformers_sdpa']}")
                else:
                    extra = "did not run: " + e["ort_cpu_error"][:160]
                g = e.get("ort_genai_cpu_matches_transformers", e.get("ort_genai_cpu_error", "")[:120] or None)
                log(f"[ort-cpu] {e['path']}: matches transformers {e['ort_cpu_matches_transformers']} ({extra})"
                    + (f"; onnxruntime-genai: {g}" if g is not None else ""))

    for e in exports:
        a, n = e["architecture"], e["exporter"]
        ae, ref = arch_entries[a], arch_entries[a]["reference"][n]
        v = versions[n]
        e.update({
            "exporter_name": EXPORTER_DIST[n], "exporter_version": v[EXPORTER_DIST[n]],
            "transformers": v["transformers"], "torch": v["torch"], "onnx": v["onnx"],
            "onnxruntime": v["onnxruntime"], "hf_config": ae["config"], "files": files_of(out / e["path"]),
            "prompt_text": PROMPT, "prompt_ids": ref["prompt_ids"], "transformers_greedy_ids": ref["greedy_ids"],
            "logits_file": ref["logits_file"], "logits_sha256": ref["logits_sha256"],
        })

    # ---- manifest (merge with entries of architectures not rebuilt by --only)
    mpath = out / "manifest.json"
    old = json.loads(mpath.read_text()) if (args.only and mpath.exists()) else {}
    keep = lambda lst: [x for x in lst if x["architecture"] not in archs]  # noqa: E731
    manifest = {
        "generator": "scripts/real_exports.py",
        "regenerate": "python scripts/real_exports.py --out golden/exports",
        "seed": SEED, "new_tokens": NEW_TOKENS, "init_std": INIT_STD,
        "prompt": {"text": PROMPT},
        "tokenizer": {"kind": "byte-level BPE trained by `tokenizers` on the script's CORPUS",
                      "vocab_size": VOCAB, "special": {"<pad>": 0, "<s>": 1, "</s>": 2}},
        "venvs": {n: {"pins": PINS[n], "versions": versions[n]} for n in PINS},
        "matrix": {"full_matrix_archs": list(FULL_MATRIX), "genai_full": [f"{p}-{e}" for p, e in GENAI_ALL],
                   "optimum_full": OPTIMUM_ALL, "others": {"genai": ["fp32-cpu"], "optimum": ["fp32"]}},
        "architectures": {**old.get("architectures", {}), **arch_entries},
        "exports": sorted(keep(old.get("exports", [])) + exports, key=lambda x: x["path"]),
        "refused": sorted(keep(old.get("refused", [])) + refused,
                          key=lambda x: (x["exporter"], x["architecture"], x["variant"])),
        "failed": sorted(keep(old.get("failed", [])) + failed,
                         key=lambda x: (x["exporter"], x["architecture"], x["variant"])),
    }
    manifest["architectures"] = dict(sorted(manifest["architectures"].items()))
    if manifest["architectures"]:
        manifest["prompt"]["ids"] = next(iter(manifest["architectures"].values()))["reference"]["genai"]["prompt_ids"]
    text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    for a, b in ((os.path.abspath(__file__), "scripts/real_exports.py"), (str(work), "$WORK"),
                 (str(out) + "/", ""), (str(out), "."), (str(venvs), "$VENVS")):
        text = text.replace(a, b)  # no machine paths in the committed manifest
    mpath.write_text(text)

    # ---- summary
    log("\n== matrix (ok / refused / FAILED)")
    for a in archs:
        cells = [f"{e['exporter']}:{e['variant']}=ok" for e in exports if e["architecture"] == a]
        cells += [f"{r['exporter']}:{r['variant']}=refused" for r in refused if r["architecture"] == a]
        cells += [f"{r['exporter']}:{r['variant']}=FAILED" for r in failed if r["architecture"] == a]
        log(f"  {a:8s} " + " ".join(cells))
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    log(f"\ntotal size of {out}: {total} bytes ({total / 2**20:.2f} MiB); wall {time.time() - t0:.0f}s")
    if total > args.max_mb * 2**20:
        print(f"error: outputs are {total / 2**20:.2f} MiB, over --max-mb {args.max_mb}", file=sys.stderr)
        return 1
    if failed:
        print(f"error: {len(failed)} export(s) failed (kept going): "
              + ", ".join(f"{r['exporter']}:{r['architecture']}-{r['variant']}" for r in failed), file=sys.stderr)
        return 1
    return 0


# ============================================================================= workers
# Everything below runs inside a venv (python real_exports.py --worker MODE IN OUT).
def run_worker(mode, inp, outp):
    payload = json.loads(Path(inp).read_text())
    fn = {"versions": w_versions, "build": w_build, "reference": w_reference, "inspect": w_inspect,
          "genai_shim": w_genai_shim}[mode]
    result = fn(**payload)
    Path(outp).write_text(json.dumps(result, sort_keys=True))
    return 0


def w_versions():
    from importlib import metadata
    out = {}
    for d in VERSION_DISTS:
        try:
            out[d] = metadata.version(d)
        except metadata.PackageNotFoundError:
            out[d] = None
    out["python"] = sys.version.split()[0]
    return out


def w_genai_shim(argv):
    """python -m onnxruntime_genai.models.builder ARGV, with AutoConfig's per-layer-type
    rope_parameters flattened back to the transformers 4.x form (see SHIM_NOTE)."""
    import runpy

    import transformers

    orig = transformers.AutoConfig.from_pretrained.__func__

    def from_pretrained(cls, *a, **k):
        cfg = orig(cls, *a, **k)
        rp = getattr(cfg, "rope_parameters", None)
        if isinstance(rp, dict) and rp and set(rp) <= {"full_attention", "sliding_attention"}:
            cfg.rope_local_base_freq = rp["sliding_attention"]["rope_theta"]
            cfg.rope_theta = rp["full_attention"]["rope_theta"]
            cfg.rope_parameters = dict(rp["full_attention"])
            print(f"[genai_shim] flattened rope_parameters {rp} -> {cfg.rope_parameters}, "
                  f"rope_local_base_freq={cfg.rope_local_base_freq}", flush=True)
        return cfg

    transformers.AutoConfig.from_pretrained = classmethod(from_pretrained)
    sys.argv = ["builder.py", *argv]
    runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)
    return {}


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=1, show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    assert [tok.token_to_id(t) for t in ("<pad>", "<s>", "</s>")] == [0, 1, 2]
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", model_max_length=COMMON["max_position_embeddings"])


def w_build(archs, dst):
    import torch
    import transformers

    torch.use_deterministic_algorithms(True)
    tokenizer = _tokenizer()
    out = {}
    for a in archs:
        cfg_cls, model_cls, extra = ARCHS[a]
        kw = dict(COMMON, **extra)
        kw = {k: v for k, v in kw.items() if not (k == "head_dim" and v is None)}
        cfg = getattr(transformers, cfg_cls)(**kw)
        cfg.architectures = [model_cls]
        cfg._attn_implementation = "eager"
        torch.manual_seed(SEED)
        model = getattr(transformers, model_cls)(cfg).eval()
        # Non-trivial biases and norm weights (the default init makes them 0 / 1).
        g = torch.Generator().manual_seed(SEED + 1)
        tw = TWEAKS.get(a, {})
        with torch.no_grad():
            if "embed_std" in tw:
                w = model.model.embed_tokens.weight
                w.copy_(torch.randn(w.shape, generator=g) * tw["embed_std"])
            if "final_norm_weight" in tw:
                model.model.norm.weight.fill_(tw["final_norm_weight"])
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.copy_(torch.randn(p.shape, generator=g) * INIT_STD)
                elif "norm" in name and name.endswith(".weight"):
                    p.add_(torch.randn(p.shape, generator=g) * 0.1)
        d = Path(dst) / a
        model.save_pretrained(d, safe_serialization=True)
        tokenizer.save_pretrained(d)
        cfgd = json.loads((d / "config.json").read_text())
        out[a] = {"config": cfgd, "tweaks": tw, "params": sum(p.numel() for p in model.parameters()),
                  "weights_size": (d / "model.safetensors").stat().st_size}
    return out


def w_reference(archs, src, dst, compare=None):
    import numpy as np
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.use_deterministic_algorithms(True)
    Path(dst).mkdir(parents=True, exist_ok=True)
    out = {}
    for a in archs:
        d = Path(src) / a
        tok = AutoTokenizer.from_pretrained(d)
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
        ids = tok(PROMPT, return_tensors="pt").input_ids
        with torch.no_grad():
            logits = model(ids).logits[0, -1].float().numpy()
            model.generation_config.eos_token_id = None
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, num_beams=1,
                                 pad_token_id=0, eos_token_id=None)
            new = gen[0, ids.shape[1]:].tolist()
            assert len(new) == NEW_TOKENS, len(new)
            # an independent greedy loop, full recompute each step (no cache)
            seq = ids
            for _ in range(NEW_TOKENS):
                nxt = model(seq).logits[0, -1].argmax()
                seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
            manual = seq[0, ids.shape[1]:].tolist()
            # what an exporter that traces SDPA attention computes (Optimum does; see README).
            # transformers 5 refuses SDPA for Gemma 2 (it cannot softcap): recorded as None.
            try:
                sdpa = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                            attn_implementation="sdpa").eval()
            except ValueError:
                sdpa = None
            gs, sdpa_diff = None, None
            if sdpa is not None:
                sdpa.generation_config.eos_token_id = None
                gs = sdpa.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                   min_new_tokens=NEW_TOKENS, do_sample=False, num_beams=1, pad_token_id=0,
                                   eos_token_id=None)[0, ids.shape[1]:].tolist()
                sdpa_diff = float(np.abs(sdpa(ids).logits[0, -1].float().numpy() - logits).max())
        p = Path(dst) / f"{a}.npy"
        np.save(p, logits.astype(np.float32))
        out[a] = {"prompt_ids": ids[0].tolist(), "greedy_ids": new, "generate_matches_manual": new == manual,
                  "manual_ids": manual, "logits_path": str(p), "greedy_ids_sdpa": gs,
                  "sdpa_logits_max_abs_diff": sdpa_diff, "logits_absmax": float(np.abs(logits).max()),
                  "transformers": transformers.__version__}
        other = Path(compare or "") / f"{a}.npy"
        if compare and Path(compare) != Path(dst) and other.exists():
            out[a]["logits_max_abs_diff_vs_compare"] = float(np.abs(np.load(other) - logits).max())
    return out


def _dims(t):
    return [d.dim_param if d.HasField("dim_param") else (d.dim_value if d.HasField("dim_value") else "?")
            for d in t.type.tensor_type.shape.dim]


def _graph_summary(path):
    import onnx
    from onnx import helper

    m = onnx.load(path, load_external_data=False)
    ops = {}
    attrs = {}
    for n in m.graph.node:
        dom = n.domain or "ai.onnx"
        ops.setdefault(dom, {}).setdefault(n.op_type, 0)
        ops[dom][n.op_type] += 1
        if dom != "ai.onnx" or n.op_type in ("Attention", "RMSNormalization", "RotaryEmbedding"):
            a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
            a = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in a.items()
                 if not hasattr(v, "ByteSize")}
            key = f"{dom}::{n.op_type}"
            s = json.dumps(a, sort_keys=True)
            lst = attrs.setdefault(key, [])
            if s not in lst:
                lst.append(s)
    def io(vs):
        return [{"name": v.name, "dtype": onnx.TensorProto.DataType.Name(v.type.tensor_type.elem_type),
                 "shape": _dims(v)} for v in vs]

    ext = sorted({e.value for i in m.graph.initializer for e in i.external_data if e.key == "location"})
    outs = {v.name: v.type.tensor_type.elem_type for v in m.graph.output}
    mismatch = sorted(f"{v.name} {onnx.TensorProto.DataType.Name(v.type.tensor_type.elem_type)} vs "
                      f"{v.name.replace('past_key_values', 'present')} "
                      f"{onnx.TensorProto.DataType.Name(outs[v.name.replace('past_key_values', 'present')])}"
                      for v in m.graph.input if v.name.startswith("past_key_values")
                      and outs.get(v.name.replace("past_key_values", "present"), v.type.tensor_type.elem_type)
                      != v.type.tensor_type.elem_type)
    return {"ir_version": m.ir_version,
            "opset_import": {(o.domain or "ai.onnx"): o.version for o in m.opset_import},
            "producer": f"{m.producer_name} {m.producer_version}".strip(),
            "ops": ops, "contrib_attributes": {k: [json.loads(s) for s in v] for k, v in sorted(attrs.items())},
            "inputs": io(m.graph.input), "outputs": io(m.graph.output), "external_data": ext,
            "past_present_dtype_mismatch": mismatch,
            "n_nodes": len(m.graph.node), "n_initializers": len(m.graph.initializer)}


def _ort_greedy(path, prompt_ids, n_new, kv_heads, head_dim, window, sliding_cache=False):
    """Plain greedy loop over an exported decoder (Optimum or GenAI I/O), growing past."""
    import numpy as np
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    np_t = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
            "tensor(int32)": np.int32}
    ins = {i.name: i for i in sess.get_inputs()}
    out_names = [o.name for o in sess.get_outputs()]
    past = {}
    for name, i in ins.items():
        if name.startswith("past_key_values"):
            # [batch, kv_heads, past_len, head_dim]; GenAI declares head_dim as "kv_cache_dim"
            # a sliding layer of GenAI (GroupQueryAttention sliding_window_cache=1, past dim 2
            # "past_sliding_length") takes a fixed buffer of capacity >= the window from the start
            b, h, p, d = i.shape
            cap = window if (sliding_cache and isinstance(p, str) and "sliding" in p) else 0
            shp = [1, h if isinstance(h, int) else kv_heads, cap, d if isinstance(d, int) else head_dim]
            past[name] = np.zeros(shp, dtype=np_t[i.type])
    seq = list(prompt_ids)
    cur = np.array([seq], dtype=np.int64)
    first_logits = None
    new = []
    for _step in range(n_new):
        plen = len(seq) - cur.shape[1]
        feed = {}
        for name, i in ins.items():
            if name == "input_ids":
                feed[name] = cur.astype(np_t[i.type])
            elif name == "attention_mask":
                feed[name] = np.ones((1, len(seq)), dtype=np_t[i.type])
            elif name == "position_ids":
                feed[name] = np.arange(plen, len(seq), dtype=np_t[i.type])[None]
            elif name in past:
                feed[name] = past[name]
            else:
                raise RuntimeError(f"unknown input {name}")
        res = dict(zip(out_names, sess.run(None, feed)))
        logits = res["logits"][0, -1].astype(np.float32)
        if first_logits is None:
            first_logits = logits
        nxt = int(logits.argmax())
        new.append(nxt)
        for k in past:  # Optimum's Gemma 2/3 fp16 exports return some present.* in float32
            past[k] = res[k.replace("past_key_values", "present")].astype(past[k].dtype, copy=False)
        seq.append(nxt)
        cur = np.array([[nxt]], dtype=np.int64)
    return new, first_logits


def _genai_runtime(folder, prompt_ids, n_new):
    import onnxruntime_genai as og

    model = og.Model(folder)
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt_ids) + n_new, min_length=len(prompt_ids) + n_new)
    gen = og.Generator(model, params)
    gen.append_tokens(list(prompt_ids))
    while not gen.is_done():
        gen.generate_next_token()
    return [int(t) for t in gen.get_sequence(0)][len(prompt_ids):]


def _err(e):
    return f"{type(e).__name__}: " + " ".join(str(e).split())[:700]


def w_inspect(jobs, new_tokens):
    import numpy as np

    out = {}
    for j in jobs:
        model = os.path.join(j["path"], "model.onnx")
        r = {"graph": _graph_summary(model)}
        try:
            import onnx

            onnx.checker.check_model(model)
            r["onnx_checker"] = "ok"
        except Exception as e:  # noqa: BLE001 - recorded
            r["onnx_checker"] = _err(e)[:300]
        cfgp = Path(j["path"]) / "genai_config.json"
        if cfgp.exists():
            r["genai_config"] = json.loads(cfgp.read_text())
        if j["check"]:
            try:
                swc = any(a.get("sliding_window_cache") for a in
                          r["graph"]["contrib_attributes"].get("com.microsoft::GroupQueryAttention", []))
                ids, lg = _ort_greedy(model, j["prompt_ids"], new_tokens, j["kv_heads"], j["head_dim"],
                                      j["window"], swc)
                ref = np.load(j["ref_logits"])
                r["ort_cpu_ids"] = ids
                r["ort_cpu_ran"] = True
                r["ort_cpu_matches_transformers"] = ids == j["expect"]
                r["ort_cpu_first_diff"] = next((i for i, (x, y) in enumerate(zip(ids, j["expect"])) if x != y), None)
                r["ort_cpu_prompt_logits_max_abs_diff"] = float(np.abs(lg - ref).max())
                r["ort_cpu_matches_transformers_sdpa"] = None if j["expect_sdpa"] is None else ids == j["expect_sdpa"]
            except Exception as e:  # noqa: BLE001 - recorded, not fatal
                r["ort_cpu_matches_transformers"] = False
                r["ort_cpu_first_diff"] = None
                r["ort_cpu_ran"] = False
                r["ort_cpu_error"] = _err(e)
            if j.get("genai_runtime"):
                try:
                    gids = _genai_runtime(j["path"], j["prompt_ids"], new_tokens)
                    r["ort_genai_cpu_ids"] = gids
                    r["ort_genai_cpu_matches_transformers"] = gids == j["expect"]
                except Exception as e:  # noqa: BLE001
                    r["ort_genai_cpu_error"] = _err(e)
        out[j["path"]] = r
    return out


def _cli():
    try:
        return main()
    except (RuntimeError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(_cli())

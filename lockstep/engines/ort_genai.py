"""ONNX Runtime GenAI as engines: ``ort-genai`` (CPU) and ``ort-genai-cuda`` (its CUDA provider).

ONNX Runtime GenAI (``onnxruntime_genai``, "og") runs a decoder as a model *folder*: ``og.Model``
reads ``genai_config.json`` beside the model file (the builder writes both) and decodes through a
``Generator``: ``append_tokens`` runs the model over new tokens with GenAI's own KV cache (a shared
past/present buffer of ``search.max_length`` positions for the builder's exports), ``get_logits`` /
``get_output("logits")`` read what the last run produced, ``generate_next_token`` is its own search.

The engine's decode session drives exactly that: ``forward(ids)`` is one ``append_tokens(ids)``
(one call with the prompt is GenAI's prefill, one call per token teacher forcing through its decode
path) and returns the model's ``logits`` output for those positions (``get_output``, in the model's
dtype); the token choice stays lockstep's (``greedy``: argmax), so the locks judge the runtime, not
its sampler. ``native_greedy`` is GenAI's own greedy search (``generate_next_token``), to check the
two agree.

Which model: the protocol hands a ``ModelProto``. The engine runs that ModelProto (its bytes, given
to GenAI with ``og.Config.add_model_data``), with the configuration of the folder it came from:
the path ``lockstep.model_source.mark_source`` recorded in the model's metadata (``lockstep decode``
records it). A model that names no folder (in memory), or whose folder has no ``genai_config.json``
describing it, is ``Unsupported`` with the reason; so is ``prepare`` (GenAI runs whole decoders,
never a single graph).

Capture: ``capture=True`` is GenAI's CUDA graphs (``enable_cuda_graph`` on its CUDA provider; it
captures the one-token steps of a shared-buffer cache). ``ort-genai`` (CPU) has none: ``Unsupported``.
GenAI does not say how many graphs it captured or replayed; ``capture_stats`` counts, as ``ort-cuda``
does, the one-token steps run with graphs enabled.

Packaging: ``onnxruntime-genai`` requires the ``onnxruntime`` distribution and
``onnxruntime-genai-cuda`` requires ``onnxruntime-gpu``; both ONNX Runtime distributions install the
one ``onnxruntime`` import package, and pip, which does not know that, installs ``onnxruntime``
(the newest: 1.32) over the ``ort`` extra's ``onnxruntime-gpu`` 1.31. The ``genai`` extra therefore
installs ``onnxruntime-genai-cuda`` (which runs the CPU provider too, with no GPU). ``available()``
names what it finds wrong: two ONNX Runtime (or two GenAI) distributions in one folder, an ONNX
Runtime older than GenAI requires, GenAI's CUDA library failing to load.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnx

from lockstep.errors import LockstepError
from lockstep.decoding import DecoderIO
from lockstep.engines.protocol import CaptureStats, RunFn, Unsupported

__all__ = ["GenAIEngine", "GenAIDecoder", "GenAIError", "cpu_engine", "cuda_engine", "INSTALL", "EXPECTATIONS"]

INSTALL = "pip install 'lockstep-conformance[genai]' (onnxruntime-genai-cuda, beside the ort extra's onnxruntime-gpu)"
EXPECTATIONS = Path(__file__).with_name("ort_genai.toml")
_ORT_DISTS = ("onnxruntime", "onnxruntime-gpu")
_GENAI_DISTS = ("onnxruntime-genai", "onnxruntime-genai-cuda")
# the CUDA provider in strict fp32 (ONNX Runtime's default is TF32), as ort-cuda
CUDA_OPTIONS = {"use_tf32": "0"}


class GenAIError(LockstepError, RuntimeError):
    """ORT GenAI failed for a reason not attributed to the model (the device, its runtime); the
    message names the engine and GenAI's own words, on one line."""


def _first_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:500]


def _device_failure(msg: str) -> bool:
    return re.search(r"cuda|cudnn|cublas|out of memory|bad_alloc", msg, re.IGNORECASE) is not None


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _dists_in(site: Path, names: Sequence[str]) -> dict[str, str]:
    """The distributions of ``names`` installed in the folder ``site`` (name -> version)."""
    from importlib.metadata import distributions

    found = {}
    for dist in distributions(path=[str(site)]):
        name = _norm(dist.metadata["Name"] or "")
        if name in names:
            found[name] = dist.version
    return found


def _requires(dist_name: str, site: Path) -> list[str]:
    from importlib.metadata import distributions

    for dist in distributions(path=[str(site)]):
        if _norm(dist.metadata["Name"] or "") == dist_name:
            return list(dist.requires or [])
    return []


class GenAIEngine:
    """ORT GenAI on one provider (``cpu`` or ``cuda``)."""

    expectations = EXPECTATIONS

    def __init__(self, device: str = "cpu", *, name: str | None = None, threads: int | None = None):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"unknown device {device!r}; one of cpu, cuda")
        from lockstep.engines.ort import _threads_from_env

        self.device = device
        self.name = name or ("ort-genai" if device == "cpu" else "ort-genai-cuda")
        self.provider_options = dict(CUDA_OPTIONS) if device == "cuda" else {}
        self.precision = {"float32": "fp32", "float16": "fp16"}
        self.threads = threads if threads is not None else _threads_from_env()
        self._avail: tuple[bool, str] | None = None
        self._og = None
        self._versions: dict[str, str] = {}

    # -- availability and versions ---------------------------------------------------------------
    def available(self) -> tuple[bool, str]:
        if self._avail is None:
            self._avail = self._probe()
        return self._avail

    def _probe(self) -> tuple[bool, str]:
        try:
            import onnxruntime as ort
        except Exception as exc:  # noqa: BLE001 - a broken install is a reason, not a crash
            return False, f"onnxruntime is not importable ({INSTALL}): {exc!r}"
        try:
            import onnxruntime_genai as og
        except ImportError as exc:
            return False, f"onnxruntime_genai is not installed ({INSTALL}): {exc}"
        except Exception as exc:  # noqa: BLE001 - e.g. its ONNX Runtime library failing to load
            return False, f"onnxruntime_genai fails to import: {type(exc).__name__}: {_first_line(exc)}"
        build = getattr(og, "__id__", "onnxruntime-genai")
        ort_site = Path(ort.__file__).resolve().parent.parent
        genai_site = Path(og.__file__).resolve().parent.parent
        both = _dists_in(ort_site, _ORT_DISTS)
        if len(both) > 1:
            return False, (f"{' and '.join(f'{n} {v}' for n, v in sorted(both.items()))} are both installed in "
                           f"{ort_site}: they share the onnxruntime import package, and the one installed last "
                           f"overwrote the other's files (onnxruntime {ort.__version__} imports); pip installs "
                           f"onnxruntime for onnxruntime-genai: uninstall both and `{INSTALL}`")
        genai = _dists_in(genai_site, _GENAI_DISTS)
        if len(genai) > 1:
            return False, (f"{' and '.join(f'{n} {v}' for n, v in sorted(genai.items()))} are both installed in "
                           f"{genai_site}: they share the onnxruntime_genai import package; keep one "
                           f"(onnxruntime-genai-cuda runs the CPU provider too)")
        lib = os.path.basename(os.environ.get("ORT_LIB_PATH", ""))  # what GenAI loaded (set by its import)
        lib_version = lib.partition(".so.")[2] if ".so." in lib else ""
        if lib_version and lib_version != ort.__version__:
            return False, (f"onnxruntime_genai loaded {lib} but the onnxruntime package is {ort.__version__}: "
                           f"two ONNX Runtime builds in {ort_site}/onnxruntime/capi")
        problem = self._requirement_problem(build, genai_site, ort.__version__)
        if problem:
            return False, problem
        try:
            og.disable_telemetry_events()
        except AttributeError:
            pass
        self._og = og
        self._versions = {"onnxruntime-genai": f"{og.__version__} ({build})", "onnxruntime": ort.__version__}
        if self.device == "cuda":
            why = self._cuda_problem(og, build)
            if why:
                return False, why
        return True, f"onnxruntime-genai {og.__version__} ({build}) on onnxruntime {ort.__version__}, {self.device}"

    @staticmethod
    def _requirement_problem(build: str, site: Path, ort_version: str) -> str:
        """GenAI's declared ONNX Runtime requirement, checked against the ONNX Runtime that imports
        (either distribution: they are one import package): '' when it holds or is not declared."""
        from packaging.requirements import InvalidRequirement, Requirement
        from packaging.version import Version

        for raw in _requires(build, site):
            try:
                req = Requirement(raw)
            except InvalidRequirement:
                continue
            if _norm(req.name) in _ORT_DISTS and req.specifier and not req.specifier.contains(
                    Version(ort_version), prereleases=True):
                return (f"{build} requires {req.name}{req.specifier} but onnxruntime {ort_version} is installed "
                        f"(the ort extra allows onnxruntime-gpu <1.32: the GenAI release for it is 0.18)")
        return ""

    def _cuda_problem(self, og, build: str) -> str:
        if build != "onnxruntime-genai-cuda":
            return f"{build} {og.__version__} has no CUDA provider: ort-genai-cuda needs onnxruntime-genai-cuda"
        lib = Path(og.__file__).with_name("libonnxruntime-genai-cuda.so")
        if lib.is_file():  # what GenAI loads for its CUDA provider; a missing CUDA library fails here
            import ctypes

            try:
                ctypes.CDLL(str(lib))
            except OSError as exc:
                return f"{build} {og.__version__}: its CUDA library does not load: {_first_line(exc)}"
        from lockstep.engines.ort import CUDA_STRICT, OrtEngine

        ok, why = OrtEngine("CUDAExecutionProvider", provider_options=CUDA_STRICT).available()
        return "" if ok else f"no usable CUDA device for ORT GenAI: {why}"

    def describe(self) -> dict[str, str]:
        self.available()
        out = {"provider": self.device, **self._versions,
               "provider_options": ", ".join(f"{k}={v}" for k, v in sorted(self.provider_options.items()))
               + (", " if self.provider_options else "") + "enable_cuda_graph per session (capture on/off)"
               if self.device == "cuda" else "defaults (CPU)",
               "model": "the ModelProto handed (og.Config.add_model_data); genai_config.json from its folder",
               "decode": "Generator.append_tokens, logits from get_output (token choice: lockstep's argmax)",
               "intra_op_threads": str(self.threads) if self.threads else "default (one per core)"}
        return out

    # -- the protocol ----------------------------------------------------------------------------
    def prepare(self, model: onnx.ModelProto) -> RunFn:
        raise Unsupported(f"{self.name}: ORT GenAI runs whole decoders from a model folder (genai_config.json) "
                          "through its Generator, never a single graph")

    def decoder(self, model: onnx.ModelProto, *, capture: bool = False,
                io: DecoderIO | None = None) -> "GenAIDecoder":
        if capture and self.device != "cuda":
            raise Unsupported(f"{self.name}: no graph capture on the CPU provider (ORT GenAI's capture is CUDA "
                              "graphs: ort-genai-cuda)")
        source, cfg = self.config_of(model)
        if capture and not cfg.share_buffer:
            raise Unsupported(f"{self.name}: ORT GenAI captures CUDA graphs only with a shared past/present buffer "
                              f"(search.past_present_share_buffer in {cfg.path})")
        ok, why = self.available()
        if not ok:
            raise Unsupported(f"{self.name}: unavailable: {why}")
        return GenAIDecoder(self, model, source, cfg, capture=capture, io=io)

    def batch_decoder(self, model: onnx.ModelProto, batch: int, *, io: DecoderIO | None = None) -> "GenAIDecoder":
        """A session on one ``og.Generator`` of ``batch_size=batch`` (``forward_rows``: one step of
        every row): what ``lockstep.decoding.batched`` runs for an engine with no single graph."""
        source, cfg = self.config_of(model)
        ok, why = self.available()
        if not ok:
            raise Unsupported(f"{self.name}: unavailable: {why}")
        return GenAIDecoder(self, model, source, cfg, io=io, batch=batch)

    def config_of(self, model: onnx.ModelProto):
        """(model file, its ``GenAIConfig``) for ``model``, or ``Unsupported`` saying why there is none."""
        from lockstep.genai_config import CONFIG_NAME, config_path_for, read_config
        from lockstep.model_source import SOURCE_KEY, source_of

        source = source_of(model)
        if source is None:
            raise Unsupported(f"{self.name}: an in-memory model: ORT GenAI runs a model folder (the model file with "
                              f"{CONFIG_NAME} beside it), and this ModelProto names no file (metadata {SOURCE_KEY}: "
                              "lockstep.model_source.mark_source)")
        path = config_path_for(source)
        if not path.is_file():
            raise Unsupported(f"{self.name}: {source} has no {CONFIG_NAME} beside it: ORT GenAI runs only models its "
                              "config describes (the builder writes one)")
        cfg = read_config(path)
        if cfg.filename != source.name:
            raise Unsupported(f"{self.name}: {path} describes {cfg.filename}, not {source.name}")
        return source, cfg


class GenAIDecoder:
    """A decode session on one ``og.Generator`` (batch 1): ``reset`` starts a new one, ``forward(ids)``
    appends ``ids`` and returns the model's logits at those positions ``[len(ids), vocab]``. With
    ``batch=B``, the generator's ``batch_size`` is B and ``forward_rows(rows)`` appends the prompts
    (one row each, equal lengths), then steps one token a row, which must be GenAI's own greedy
    choice (it takes no second append for a batch), returning ``[B, n, vocab]``."""

    def __init__(self, engine: GenAIEngine, model: onnx.ModelProto, source: Path, cfg, *, capture: bool = False,
                 io: DecoderIO | None = None, batch: int = 1):
        from lockstep.genai_config import card_for

        og = engine._og
        self.og, self.engine, self.source, self.cfg = og, engine, source, cfg
        self.io = io or DecoderIO.of(model, card_for(source))
        self.capture = capture
        self.max_length = cfg.max_length if cfg.share_buffer else (cfg.max_length or cfg.context_length)
        # GenAI keeps a pointer to these bytes, not a reference: they must outlive the og.Model (0.18.0
        # crashed in og.Model when the buffer had been freed). External data stays in its file: GenAI
        # reads it from the config's folder, the model's (the graph's bytes only, never past 2 GiB)
        from lockstep.loading import serialized

        self._bytes = serialized(model, engine.name)
        try:
            config = og.Config(str(source.parent))
            # ONNX Runtime's own log off (a refusal is raised, and said once, by lockstep), as ort-cpu's;
            # overlaid first: the providers below are set on what it leaves
            options: dict[str, Any] = {"log_severity_level": 4}
            if engine.threads:
                options.update(intra_op_num_threads=engine.threads, inter_op_num_threads=1)
            config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
            config.clear_providers()
            if engine.device == "cuda":
                config.append_provider("cuda")
                for key, value in {**engine.provider_options, "enable_cuda_graph": "1" if capture else "0"}.items():
                    config.set_provider_option("cuda", key, value)
            config.add_model_data(cfg.filename, self._bytes)
            self.model = og.Model(config)
            self.params = og.GeneratorParams(self.model)
            self.params.set_search_options(max_length=self.max_length, do_sample=False, batch_size=batch)
        except Exception as exc:  # noqa: BLE001 - GenAI raises RuntimeError for everything
            self._raise_open(exc)
        got = str(getattr(self.model, "device_type", "")).lower()
        if got and got != engine.device:  # a provider GenAI silently replaced must not pass as the one asked for
            raise GenAIError(f"{engine.name}: the {engine.device} provider was asked for but ORT GenAI's model runs "
                             f"on {got}")
        self.one_token_steps = 0
        self.batch = batch
        self.generator = None
        self.reset()

    def _raise_open(self, exc: Exception):
        from lockstep.loading import ModelError

        msg = _first_line(exc)
        what = f"{self.engine.name} (ORT GenAI {self.og.__version__})"
        if "cannot use the graph capture feature" in msg.lower():  # an -e cpu export: nodes left on the CPU
            from lockstep.engines.protocol import Unsupported

            raise Unsupported(f"{what}: its CUDA graphs need every node on the CUDA provider (a model exported "
                              f"for the CPU keeps nodes there): {msg}") from exc
        if _device_failure(msg):
            raise GenAIError(f"{what} fails to open the model on its device: {msg}") from exc
        raise ModelError(f"{what} refuses the model: {msg}") from exc

    def reset(self) -> None:
        self.generator = None  # the old one's cache is freed before the new one's is allocated
        try:
            self.generator = self.og.Generator(self.model, self.params)
        except Exception as exc:  # noqa: BLE001
            self._raise_step(exc, "creating a generator")
        self.position = 0

    def _raise_step(self, exc: Exception, where: str):
        from lockstep.loading import ModelError

        msg = _first_line(exc)
        what = f"ORT GenAI {self.og.__version__} fails {where}"
        if _device_failure(msg):
            raise GenAIError(f"{self.engine.name}: {what}: {msg}") from exc
        raise ModelError(f"{what}: {msg}") from exc

    def forward(self, ids: Sequence[int]) -> np.ndarray:
        ids = [int(t) for t in ids]
        n = len(ids)
        self.io.check_room(self.position, n)
        try:
            self.generator.append_tokens(np.asarray(ids, dtype=np.int32))
            logits = np.asarray(self.generator.get_output(self.io.logits))
        except Exception as exc:  # noqa: BLE001
            self._raise_step(exc, f"at a decode step (position {self.position}, {n} token(s))")
        if logits.ndim != 3 or logits.shape[0] != 1 or logits.shape[1] != n:
            from lockstep.loading import ModelError

            raise ModelError(f"ORT GenAI {self.og.__version__} returned logits of shape {list(logits.shape)} for "
                             f"{n} token(s) at position {self.position} (expected [1, {n}, vocab])")
        if n == 1:
            self.one_token_steps += 1
        self.position += n
        return np.array(logits[0])

    def forward_rows(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        """One step of every row of the batch (equal lengths): the logits ``[batch, n, vocab]``."""
        n = len(rows[0]) if rows else 0
        if len(rows) != self.batch or any(len(r) != n for r in rows):
            from lockstep.decoder_io import StepError

            raise StepError(f"a batch step needs {self.batch} rows of one length, got lengths {[len(r) for r in rows]}")
        self.io.check_room(self.position, n)
        fed = [[int(t) for t in r] for r in rows]
        where = f"at a batch step (batch {self.batch}, position {self.position}, {n} token(s))"
        try:
            if self.position == 0:
                self.generator.append_tokens(np.asarray(fed, dtype=np.int32))
                self._chose = False
            else:
                # GenAI appends once for batch_size > 1: every later step is its own greedy choice,
                # ``generate_next_token`` (choose from the logits at hand, then run the model on it)
                if not self._chose:
                    self.generator.generate_next_token()  # the choice from the prefill's logits
                    self._chose = True
                chosen = [[int(t)] for t in self.generator.get_next_tokens()]
        except Exception as exc:  # noqa: BLE001
            self._raise_step(exc, where)
        if self.position > 0 and fed != chosen:
            from lockstep.decoder_io import StepError

            raise StepError(f"{self.engine.name}: after the prompt a batch steps by ORT GenAI's own greedy choice "
                            f"{chosen}, not {fed}")
        try:
            if self.position > 0:
                self.generator.generate_next_token()
            logits = np.asarray(self.generator.get_output(self.io.logits))
        except Exception as exc:  # noqa: BLE001
            self._raise_step(exc, where)
        if logits.shape[:2] != (self.batch, n):
            from lockstep.loading import ModelError

            raise ModelError(f"ORT GenAI {self.og.__version__} returned logits of shape {list(logits.shape)} for a batch "
                             f"of {self.batch} rows of {n} token(s) (expected [{self.batch}, {n}, vocab])")
        self.position += n
        return np.array(logits)

    def native_greedy(self, prompt: Sequence[int], n_tokens: int) -> list[int]:
        """GenAI's own greedy search (``do_sample=False``): the prompt appended, then ``n_tokens`` calls of
        ``generate_next_token`` (each chooses from the logits at hand and runs the model on the token
        chosen before it); a fresh generator, left as the session's."""
        self.reset()
        out = []
        try:
            self.generator.append_tokens(np.asarray(list(prompt), dtype=np.int32))
            for _ in range(n_tokens):
                self.generator.generate_next_token()
                out.append(int(self.generator.get_next_tokens()[0]))
        except Exception as exc:  # noqa: BLE001
            self._raise_step(exc, "in its own greedy search")
        self.position = len(prompt) + max(n_tokens - 1, 0)
        return out

    def capture_stats(self) -> CaptureStats:
        """With CUDA graphs: GenAI captures the one-token step (one graph) and replays it; it does not
        report captures or replays, so this counts the one-token steps run with graphs enabled, as
        ort-cuda does."""
        if not self.capture:
            return CaptureStats()
        return CaptureStats(captures=1 if self.one_token_steps else 0, replays=self.one_token_steps,
                            detail={"one_token_steps_with_cuda_graphs": self.one_token_steps,
                                    "counted": "one-token steps (ORT GenAI does not report its graphs)"})

    def counters(self) -> dict[str, Any]:
        return {"ort_genai": {"version": self.og.__version__, "device": self.engine.device,
                              "cuda_graphs": self.capture, "max_length": self.max_length,
                              "one_token_steps": self.one_token_steps}}


def cpu_engine() -> GenAIEngine:
    """Entry point ``ort-genai``."""
    return GenAIEngine("cpu")


def cuda_engine() -> GenAIEngine:
    """Entry point ``ort-genai-cuda``: the CUDA provider in strict fp32 (use_tf32=0)."""
    return GenAIEngine("cuda")

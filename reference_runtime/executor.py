"""The ONNX executor: a model on a runtime, run node by node through registered kernels.

Load: the model is checked (``model.load_model``; opsets newer than onnx knows are
``UnsupportedModel``), its nodes are put in topological order,
``Constant`` nodes and initializers become device tensors once, and every other node is matched to
a kernel (``kernels.registry``). Any node without one is reported before anything executes,
with op type, domain and opset (``UnsupportedModel``). Control flow (If, Loop, Scan,
FlexAttention with modifier subgraphs) is run by the executor itself (``control_flow``): its
subgraphs are built as nested executors at load, checked the same way. The model's symbolic dims (onnx's shape
inference, contained: ``symbols``, ``symbolic_shapes``) are worked out on first need, by the
capture planner or a second run of a step signature; a one-shot run never needs them.

Run: feeds are checked against the graph's declared inputs (names, dtypes, ranks, fixed dims, and
symbolic dims bound consistently: one symbol, one value), uploaded, then each node's output specs
are inferred (``OpKernel.shapes``; inputs in ``host_inputs`` are read back first, the node's host
seam), outputs are allocated and the node's kernel is launched on the runtime. Only the runtime's
primitives touch the device, so the simulated device's ordering and race checks apply to every op.
Sequences, optionals and string tensors are host values (``host_values``): their nodes run on the
host, and a graph holding any has no execution plans.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import weakref
from types import MappingProxyType
from typing import Any

import numpy as np
import onnx
from lockstep.kernels import (
    MEMO_MIN_MODEL_BYTES,
    as_check,
    is_host_error,
    KernelHostError,
    NodeInfo,
    OpError,
    small_in_dtypes,
    Spec,
    validate_node,
)
from lockstep.kernels.registry import EXECUTOR_OPS, REGISTRY, Registry

from lockstep.errors import FeedError
from lockstep.loading import ModelError, UnsupportedModel, check_opsets, load_model, np_dtype, tensor_to_numpy

from .errors import IllegalState
from .host_values import check_feed, fetch, host_valued, place_feed, run_host_step
from .plan import PlanCache
from .runtime import Relaunch, Runtime, Tensor
from .control_flow import CONTROL_OPS, build_control, implicit_inputs, is_control
from .fusion import fuse_steps
from .steps import ALIAS_OPS, _node_kernel, _Step, _topological, node_attrs
from .values import Run, Value
from .symbols import Symbol, symbolic_shapes

__all__ = ["Executor", "Run", "FeedError", "ModelError", "Symbol", "UnsupportedModel"]


_CONTROL_TYPES = frozenset(op for _, op in CONTROL_OPS)  # op types that may hold subgraphs


class Executor:
    """A loaded model bound to a runtime. ``run(feeds)`` returns the graph outputs as numpy arrays."""

    PAGE_MIN = 4096  # bytes: initializers at least this large are paged when the runtime has a vram_limit
    CHECK_MODEL = True  # onnx.checker at load (off for a subgraph's executor: control_flow.Body)
    FUSE = True  # kernel fusion at load (``fusion``; off for a subgraph's executor)

    def __init__(self, model: Any, runtime: Runtime, *, registry: Registry = REGISTRY):
        self.model, self.base_dir = load_model(model, check=self.CHECK_MODEL)
        self.registry = registry
        check_opsets(self.model)
        self.runtime = runtime
        self._raw_storage = runtime.device.RAW_STORAGE
        graph = self.model.graph
        self.opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in self.model.opset_import}
        self._names = itertools.count()
        self._source = model if isinstance(model, (str, os.PathLike)) else None  # named in inference errors
        self._symbolic: "tuple[dict[str, Symbol], dict[str, tuple]] | None" = None  # on first need
        # cache name -> its sequence axis, where a decoder states its roles (capture_plan.growing_symbols)
        self.kv_roles: dict[str, int] | None = None
        init_names = {t.name for t in graph.initializer}
        self.inputs = [vi for vi in graph.input if vi.name not in init_names]
        self.outputs = [vi.name for vi in graph.output]
        # inputs that are sequences, optionals or string tensors (``host_values``): name -> type
        self._host_feeds = {vi.name: vi.type for vi in self.inputs if host_valued(vi.type)}
        host_io = bool(self._host_feeds) or any(host_valued(vi.type) for vi in graph.output)
        nodes = list(graph.node)
        io = [(tuple(n.input), tuple(n.output)) for n in nodes]  # read once: each read builds new strings
        implicit = {k: implicit_inputs(n) for k, n in enumerate(nodes) if n.op_type in _CONTROL_TYPES}
        for k, extra in implicit.items():  # outer-scope reads order the graph like inputs
            io[k] = (io[k][0] + extra, io[k][1])
        order = _topological(graph, init_names | {vi.name for vi in graph.input}, io)
        self.steps: list[_Step] = []
        self._constants: dict[str, np.ndarray] = {t.name: tensor_to_numpy(t, self.base_dir) for t in graph.initializer}
        unsupported: list[str] = []
        fed = {vi.name for vi in self.inputs}
        for k in order:
            node, (ins, outs) = nodes[k], io[k]
            op_type = node.op_type
            domain = "" if node.domain == "ai.onnx" else node.domain
            opset = self.opsets.get(domain)
            name = node.name or f"{op_type}_{next(self._names)}"
            if opset is None:
                unsupported.append(f"{name}: domain {domain!r} is not imported by the model")
                continue
            try:
                attrs = node_attrs(node, self.base_dir)
            except Exception as exc:
                raise ModelError(f"node {name!r} ({op_type}): bad attribute: {exc}") from exc
            info = NodeInfo(name, op_type, domain, opset, attrs, len(ins) - len(implicit.get(k, ())), len(outs))
            if (domain, op_type) in EXECUTOR_OPS:
                if op_type == "Constant":
                    self._constants[outs[0]] = self._constant_value(info)
                else:
                    self.steps.append(_Step(node, info, None, None, False, ins, outs))
                continue
            if op_type in _CONTROL_TYPES and is_control(domain, op_type, node):  # subgraphs built and validated now
                control = build_control(self, info, node, implicit.get(k, ()))
                self.steps.append(_Step(node, info, None, None, False, ins, outs, control))
                continue
            kernel = registry.lookup(domain, op_type, opset)
            if kernel is None:
                unsupported.append(f"{name}: {registry.why_not(domain, op_type, opset)}")
                continue
            # arity and attributes, before anything executes: OpError naming node and input or attribute
            validate_node(kernel, info, tuple(i for i, x in enumerate(ins) if not x))
            present = tuple(bool(i) for i in ins)
            self.steps.append(_Step(node, info, kernel, _node_kernel(kernel, info, present, len(outs)),
                                    self._aliases(op_type, domain, ins, outs, fed), ins, outs))
        if unsupported:
            raise UnsupportedModel("model uses operators this runtime cannot run", unsupported)
        # Nodes no graph output depends on are not run (ONNX Runtime's graph optimizer removes them
        # too). They were loaded and validated above: a bad one is still refused at load.
        live, kept = set(self.outputs), []
        for st in reversed(self.steps):
            if any(o in live for o in st.outputs if o):
                live.update(i for i in st.inputs if i)
                kept.append(st)
        alive = {id(st) for st in kept}
        self.pruned: tuple[str, ...] = tuple(st.info.name for st in self.steps if id(st) not in alive)
        self.steps = kept[::-1]
        inits = {t.name for t in graph.initializer}
        weights = sum(np.asarray(v).nbytes for n, v in self._constants.items() if n in inits)
        # a large model's Transpose of a weight, done once at load (ONNX Runtime folds it too): GenAI's
        # builder writes a tied embedding as Gather(Transpose(lm_head)), 0.9 GB transposed every step
        self.folded: tuple[str, ...] = ()
        if runtime.config.vram_limit is None and weights >= MEMO_MIN_MODEL_BYTES:
            self.steps, self.folded = self._fold_weight_transposes(self.steps, inits)
        # groups of nodes run as one step and one launch, with their bits (``fusion``)
        self.fused: tuple[str, ...] = ()
        if runtime.config.fuse_kernels and self.FUSE:
            self.steps, self.fused = fuse_steps(self.steps, set(self.outputs), self._constants, self._elem_types)
        self._const_values: dict[str, Value] = {}
        self.pager = None
        if runtime.config.vram_limit is not None:  # weights paged under stable addresses
            from .pager import WeightPager

            self.pager = WeightPager(runtime, runtime.config.vram_limit)
        for name, value in self._constants.items():
            arr = np.asarray(value)
            if (self.pager is not None and name in inits and arr.dtype != object and arr.nbytes >= self.PAGE_MIN):
                self._const_values[name] = Value(self.pager.register(name, arr), Spec(tuple(arr.shape), arr.dtype, arr))
            else:
                self._const_values[name] = self._place(value, name)
        # per step: the paged weights it reads (made resident before it launches)
        self.paged_inputs: dict[str, list[str]] = {} if self.pager is None else {
            st.info.name: [i for i in st.inputs if i and self.pager.is_paged(i)] for st in self.steps}
        if self.pager is not None:  # a view of a paged weight would escape the pager's residency
            self.steps = [dataclasses.replace(st, alias=False) if st.alias and self.pager.is_paged(st.inputs[0])
                          else st for st in self.steps]
        if self.pager is None and weights >= MEMO_MIN_MODEL_BYTES:  # a large model, its weights resident:
            # each node's initializer inputs, for kernels' memos of what they derive from them alone
            # (``kernels._op.const_memo``: weights upcast or dequantized once, not every decode step)
            self.steps = [dataclasses.replace(st, info=st.info.with_consts(
                frozenset(i for i, name in enumerate(st.inputs) if name in inits)))
                if st.kernel is not None and any(name in inits for name in st.inputs) else st for st in self.steps]
        self._producer: dict[str, int] = {o: i for i, st in enumerate(self.steps) for o in st.outputs if o}
        self._output_names = frozenset(self.outputs)
        self._declared = [vi.name for vi in self.inputs]  # the feed names, in order (``_feed_rules``' too)
        # Steady-state caches of ``start`` (a decode loop feeds the same shapes and tensors every step):
        # the (dtype, shape) per input that passed ``_check_feeds``; per bound output, the feeds a
        # later node reads (binding over them is unsafe); a device feed's value entry, by identity.
        self._feeds_ok: set[tuple] = set()
        self._unsafe_over: dict[str, frozenset[str]] = {}
        self._feed_values: dict[int, Value] = {}
        self._readers: dict[str, list[int]] = {}
        for i, st in enumerate(self.steps):
            for name in st.inputs:
                if name:
                    self._readers.setdefault(name, []).append(i)
        # execution plans per step signature (``reference_runtime.plan``); off with paged weights,
        # whose residency the pager decides per node. The cache names this executor through a weak
        # proxy: no executor<->cache cycle, so a dropped executor (and its runtime, whose finalizer
        # drains and frees) goes at once, not at the next cyclic garbage collection
        # host values (sequences, optionals, strings) anywhere: some nodes run on the host
        # (``host_values``), which execution plans do not replay; nor control flow: a branch or a trip
        # count may change shapes under one signature
        self._hostish = (host_io or any(st.kernel is not None and st.kernel.host is not None for st in self.steps)
                         or any(np.asarray(v).dtype == object for v in self._constants.values()))
        self.host_steps: set[str] = {st.info.name for st in self.steps if st.kernel is not None and st.kernel.host}
        self.plans: PlanCache | None = (PlanCache(weakref.proxy(self)) if runtime.config.execution_plans
                                        and self.pager is None and not self._hostish
                                        and not any(st.control is not None for st in self.steps) else None)
        if self.model.graph.value_info:  # a declaration that contradicts its node: named at load, not steps later
            self._symbolic_dims()

    def _symbolic_dims(self) -> "tuple[dict[str, Symbol], dict[str, tuple]]":
        if self._symbolic is None:
            try:
                self._symbolic = symbolic_shapes(self.model, checked=True)  # load_model checked it
            except ModelError as exc:  # onnx's inference crashed or ran away: name the file when there is one
                raise ModelError(f"{self._source}: {exc}" if self._source is not None else str(exc)) from None
        return self._symbolic

    def _elem_types(self) -> dict[str, int]:
        """Each value's onnx elem type, by onnx's inference (contained; {} when it fails: no fusion)."""
        from lockstep.inference import infer

        try:
            g = infer(self.model, checked=True).graph
        except ModelError:
            return {}
        types = {vi.name: vi.type.tensor_type.elem_type for vi in [*g.input, *g.value_info, *g.output]
                 if vi.type.HasField("tensor_type")}
        for name, value in self._constants.items():
            arr = np.asarray(value)
            if arr.dtype != object:
                try:
                    types[name] = onnx.helper.np_dtype_to_tensor_dtype(arr.dtype)
                except (KeyError, ValueError, TypeError):
                    pass
        return types

    @property
    def symbols(self) -> "dict[str, Symbol]":
        """The model's symbolic dims by name (``symbols.symbolic_shapes``). Computed on first need (the
        capture planner, a second run of a step signature): onnx's inference, contained
        (``inference.infer``), is not spent on a one-shot run, which never reads it."""
        return self._symbolic_dims()[0]

    @property
    def symbolic_shapes(self) -> "dict[str, tuple[int | Symbol, ...]]":
        """Each value's dims, ints or ``Symbol`` (see ``symbols``; computed on first need)."""
        return self._symbolic_dims()[1]

    @property
    def constants(self) -> "MappingProxyType[str, np.ndarray]":
        """The model's constant values (initializers and Constant nodes) on the host, read-only."""
        return MappingProxyType(self._constants)

    def _aliases(self, op_type: str, domain: str, ins: tuple[str, ...], outs: tuple[str, ...], fed: set[str]) -> bool:
        """Whether the node's output is a view of its input (``ALIAS_OPS``; ``fed``: the graph's inputs)."""
        if domain != "" or op_type not in ALIAS_OPS or not ins or not ins[0]:
            return False
        return ins[0] not in fed and outs[0] not in self.outputs

    def _constant_value(self, info: NodeInfo) -> np.ndarray:
        a = info.attrs
        if "value" in a:
            return np.asarray(a["value"])
        for key, dt in (("value_float", np.float32), ("value_int", np.int64)):
            if key in a:
                return np.asarray(a[key], dtype=dt)
        for key, dt in (("value_floats", np.float32), ("value_ints", np.int64)):
            if key in a:
                return np.asarray(a[key], dtype=dt)
        raise UnsupportedModel("Constant", [f"{info.name}: attribute form {sorted(a)} is not supported"])

    def _place(self, value: np.ndarray, name: str) -> Value:
        value = np.asarray(value)
        spec = Spec(tuple(value.shape), value.dtype, value)
        if value.dtype == object:  # a string tensor: kept on the host (``host_values``)
            return Value(None, spec)
        return Value(self.runtime.upload(value, name=name), spec)

    # -- feeds
    def _feed_rules(self) -> list[tuple[str, Any, int | None, tuple[tuple[int, int | None, str | None], ...]]]:
        """Per declared input, what ``_check_feeds`` checks, read from the graph once: (name, dtype,
        rank or None, ((axis, fixed dim or None, symbol or None), ...))."""
        rules = self.__dict__.get("_rules")
        if rules is None:
            rules = []
            for vi in self.inputs:
                if vi.name in self._host_feeds:  # checked by ``host_values.check_feed``
                    rules.append((vi.name, None, None, ()))
                    continue
                tt = vi.type.tensor_type
                if not tt.HasField("shape"):
                    rules.append((vi.name, np_dtype(tt.elem_type), None, ()))
                    continue
                dims = tuple((k, d.dim_value if d.HasField("dim_value") else None,
                              d.dim_param if d.HasField("dim_param") else None) for k, d in enumerate(tt.shape.dim))
                rules.append((vi.name, np_dtype(tt.elem_type), len(dims), dims))
            self._rules = rules
        return rules

    def _check_feeds(self, feeds: dict[str, Any]) -> dict[str, "np.ndarray | Tensor"]:
        rules = self._feed_rules()
        declared = self._declared
        if len(feeds) != len(declared) or any(k not in feeds for k in declared):
            keys = [k for k in feeds if not isinstance(k, str)]
            if keys:
                raise FeedError(f"feed names must be strings, got {keys[:5]!r}; the model's inputs are {sorted(declared)}")
            unknown = sorted(set(feeds) - set(declared))
            if unknown:
                raise FeedError(f"unknown feed(s) {unknown}; the model's inputs are {sorted(declared)}")
            missing = [n for n in declared if n not in feeds]
            if missing:
                raise FeedError(f"missing feed(s) {missing}")
        out = {}
        seen = []  # (dtype, shape) per input: the dtype and shape checks below depend on nothing else
        for name, want, _, _ in rules:
            value = out[name] = feeds[name]
            if want is None:
                out[name] = check_feed(name, self._host_feeds[name], value, FeedError)
                seen.append(None)
            elif isinstance(value, Tensor):
                if value.runtime is not self.runtime or value.freed:
                    raise FeedError(f"input {name!r}: device tensor {value!r} is freed or belongs to another runtime")
                seen.append((value.ref.dtype, value.ref.shape))
            elif isinstance(value, np.ndarray):
                seen.append((value.dtype, value.shape))
            else:
                raise FeedError(f"input {name!r}: expected a numpy array or a device Tensor, got {type(value).__name__}")
        key = tuple(seen)
        if key in self._feeds_ok:
            return out
        symbols: dict[str, tuple[int, str]] = {}
        for name, want, rank, dims in rules:
            value = feeds[name]
            if want is None:  # a host value, checked above
                continue
            if value.dtype != want:
                raise FeedError(f"input {name!r}: dtype {value.dtype} given, {want} declared")
            if rank is not None:
                shape = value.shape
                if rank != len(shape):
                    raise FeedError(
                        f"input {name!r}: rank {len(shape)} given (shape {tuple(shape)}), rank {rank} declared"
                    )
                for axis, fixed, param in dims:
                    n = shape[axis]
                    if fixed is not None and fixed != n:
                        raise FeedError(f"input {name!r}: dim {axis} is {n}, declared {fixed}")
                    if param is not None:
                        prev = symbols.setdefault(param, (n, name))
                        if prev[0] != n:
                            raise FeedError(
                                f"input {name!r}: dim {axis} ({param!r}) is {n}, but {prev[1]!r} bound it to {prev[0]}"
                            )
        if len(self._feeds_ok) >= 256:  # a growing cache feeds a new shape every step: keep it bounded
            self._feeds_ok.clear()
        self._feeds_ok.add(key)
        return out

    # -- run
    def run(self, feeds: dict[str, Any], *, keep: "set[str] | frozenset[str]" = frozenset(),
            bind: "dict[str, Tensor] | None" = None, retain: "list[Tensor] | None" = None) -> dict[str, Any]:
        """Run the graph. Feeds are numpy arrays (uploaded) or this runtime's device Tensors (bound
        as they are, never freed here). Outputs named in ``keep`` come back as device Tensors the
        caller owns (and frees); the others as numpy arrays. Outputs named in ``bind`` are written
        into the given Tensors (IO binding), which may be feeds of this run (in place: refused
        unless the producing node is the last reader of that feed). With ``retain``, the run's
        intermediate tensors are appended to it instead of freed: a captured graph baked their
        addresses, so they live as long as the graph.

        From the second run of a step signature on, the run follows that signature's execution
        plan (``reference_runtime.plan``; ``RuntimeConfig.execution_plans``): the same launches on
        the same kind of arguments, without the per-node inference and allocation."""
        plans = self.plans
        plan = None
        if plans is not None and retain is None and not self.runtime.is_capturing:
            plan = plans.lookup(feeds)
        r = self.start(feeds, keep=keep, bind=bind, feed_buffers=plan.feed_buffers if plan is not None else None)
        try:
            if plan is not None:
                plan.execute(self, r)
            else:
                if plans is not None and retain is None and not self.runtime.is_capturing:
                    r.record = {}
                for i in range(len(self.steps)):
                    self.step(r, i)
                if r.record is not None:
                    plans.remember(feeds, r.record)
            return self.finish(r)
        finally:
            self.release(r, retain=retain)

    # -- the step API (segmented capture drives a run node by node through it)
    def body(self, model: onnx.ModelProto) -> "Executor":
        """An executor over a subgraph of this one's model (``control_flow.Body``), on the same
        runtime and registry: not checked on its own, never planned."""
        return _BodyExecutor(model, self.runtime, registry=self.registry)

    def start(self, feeds: dict[str, Any], *, keep: "set[str] | frozenset[str]" = frozenset(),
              bind: "dict[str, Tensor] | None" = None, feed_buffers: "dict[str, Tensor] | None" = None) -> "Run":
        """Check keep/bind and the feeds, upload host feeds: a ``Run`` at its first node. A host
        feed with a buffer of its shape in ``feed_buffers`` is written into it (no allocation)."""
        rt = self.runtime
        rt.current_node = None  # feeds are no node's: a refused upload must not name the last run's
        bind = dict(bind or {})
        keep = frozenset(keep)
        names = self._output_names
        if not (names.issuperset(keep) and names.issuperset(bind)):
            unknown = sorted((keep | set(bind)) - names)
            raise FeedError(f"keep/bind name {unknown}, which are not graph outputs {self.outputs}")
        self._check_in_place(feeds, bind)
        run = Run(dict(self._const_values), [], keep, bind)
        env = run.env
        values = self._feed_values
        for name, value in self._check_feeds(feeds).items():
            if name in self._host_feeds:
                env[name] = place_feed(rt, self._host_feeds[name], value, name, run.temps)
                continue
            if isinstance(value, Tensor):  # a tensor's shape and dtype never change: its entry is reused
                v = values.get(id(value))
                if v is None or v.tensor is not value:
                    if len(values) >= 256:
                        values.clear()
                    v = values[id(value)] = Value(value, Spec(tuple(value.shape), value.dtype))
                env[name] = v
                continue
            spec = Spec(tuple(value.shape), value.dtype)
            held = feed_buffers.get(name) if feed_buffers else None
            if held is not None and tuple(held.shape) == spec.shape and held.dtype == spec.dtype:
                rt.write(held, value)  # stream-ordered after the kernels that read the last step's
                env[name] = Value(held, spec)
                continue
            v = Value(rt.upload(value, name=name), spec)
            env[name] = v
            run.temps.append(v.tensor)  # type: ignore[arg-type]
        return run

    def finish(self, run: "Run") -> dict[str, Any]:
        """The graph outputs: bound tensors, kept device tensors (the caller owns them), or numpy."""
        rt = self.runtime
        rt.current_node = None  # the run's own downloads and frees: no node's (not the last node's)
        env = run.env
        missing = [o for o in self.outputs if o not in env]
        if missing:
            raise ModelError(f"graph outputs {missing} were never produced")
        result: dict[str, Any] = {}
        temp_ids = {id(t) for t in run.temps}
        for o in self.outputs:
            v = env[o]
            if v is None or type(v) is not Value or v.tensor is None:  # a sequence, optional or strings
                if o in run.bind or o in run.keep:
                    raise FeedError(f"output {o!r} is not a device tensor: it cannot be kept or bound")
                result[o] = fetch(rt, v)
                continue
            t = v.tensor
            if o in run.bind:
                result[o] = t
            elif o not in run.keep:
                result[o] = rt.download(t)
            elif id(t) in temp_ids and id(t) not in run.handed:
                run.handed.add(id(t))
                result[o] = t
            else:  # a constant, a feed, a persistent buffer, or already handed out: the caller gets its own copy
                own = rt.empty(t.shape, t.dtype, name=o)
                rt.copy(own, t)
                result[o] = own
        return result

    def release(self, run: "Run", *, retain: "list[Tensor] | None" = None) -> None:
        """Free the run's temporaries (stream-ordered), or append them to ``retain``. Idempotent."""
        rt = self.runtime
        rt.current_node = None  # the run's frees are no node's, after a node that raised too
        temps, run.temps = run.temps, []
        for t in temps:
            if not t.freed and id(t) not in run.handed:
                if retain is not None:
                    retain.append(t)
                else:
                    rt.free(t)

    def step(self, run: "Run", i: int, *, persist: "dict[str, Tensor] | None" = None,
             temps: "list[Tensor] | None" = None) -> None:
        """Run node ``i`` of ``steps`` on ``run``: infer its output specs (reading host inputs back
        where the host does not know them: the node's host seam), allocate its outputs (into
        ``temps``, by default the run's), launch its kernel. ``persist`` maps value names to
        persistent buffers (segmented capture: a seam writes a value a captured segment reads into
        the buffer that segment's graph baked)."""
        step = self.steps[i]
        info, rt = step.info, self.runtime
        env = run.env
        temps = run.temps if temps is None else temps
        values = [env[n] if n else None for n in step.inputs]
        if step.kernel is None:
            if step.control is not None:  # If, Loop, Scan, FlexAttention (control_flow)
                rt.current_node = info.name
                step.control.run(self, run, values, temps, persist, step.outputs)
                return
            env[step.outputs[0]] = values[0]  # Identity: alias, no launch  # type: ignore[assignment]
            return
        if self._hostish and (step.kernel.host is not None or any(
                v is not None and (type(v) is not Value or v.tensor is None) for v in values)):
            self.host_steps.add(info.name)  # a host seam (capture_plan)
            run_host_step(rt, run, step, values, persist, temps)
            return
        specs: list[Spec | None] = [v.spec if v is not None else None for v in values]
        rt.current_node = info.name  # attribution for the runtime's sync-debug log (host reads, launch)
        for k in step.kernel.host_inputs:
            if k < len(values) and values[k] is not None and specs[k].value is None:  # type: ignore[union-attr]
                host = rt.download(values[k].tensor)  # the node's host seam
                specs[k] = Spec(specs[k].shape, specs[k].dtype, host)  # type: ignore[union-attr]
        try:
            out_specs = list(step.kernel.shapes(info, specs))
        except Exception as exc:  # a kernel's own shape code failing is named after its node
            if isinstance(exc, OpError) or not is_host_error(exc):
                raise
            raise KernelHostError(step.launch, {"node": info}, exc) from exc
        out_specs = self._fold_host_values(step, info, specs, out_specs)
        host = {k: specs[k].value for k in step.kernel.host_inputs if k < len(specs) and specs[k] is not None}
        checks = tuple(as_check(c) for c in step.kernel.index_checks(info, specs)) if step.kernel.index_checks else ()
        if checks and any(c.by is not None for c in checks):
            checks = self._fresh_checks(run, step, checks)
        # on a raw-bit device, the small types among the node's values (kernels/_small.py)
        call = info.for_run(tuple(out_specs), host, checks,
                            small_in_dtypes(specs, out_specs) if self._raw_storage else ())
        if run.record is not None:
            run.record[i] = (tuple(out_specs), call, specs)
        if step.alias and not (persist and step.outputs[0] in persist) and step.is_view(specs[0]):
            src = values[0].tensor  # type: ignore[union-attr]
            spec = out_specs[0]
            view = rt.wrap(src.ref.buffer, spec.shape, spec.dtype, offset=src.ref.offset, name=step.outputs[0])
            env[step.outputs[0]] = Value(view, spec)
            return  # a view of its input: no allocation, no launch (as a real runtime's Reshape)
        outs: list[Tensor] = []
        for name, spec in zip(step.outputs, out_specs):
            bound = run.bind.get(name)
            held = persist.get(name) if persist else None
            if bound is not None:
                if tuple(bound.shape) != tuple(spec.shape) or bound.dtype != spec.dtype:
                    raise FeedError(f"output {name!r} is bound to {bound!r} but is {spec.dtype}{list(spec.shape)}")
                t = bound
            elif held is not None:
                if tuple(held.shape) != tuple(spec.shape) or held.dtype != spec.dtype:
                    raise IllegalState(
                        f"node {info.name!r}: value {name!r} is {spec.dtype}{list(spec.shape)} but the buffer "
                        f"its readers were prepared with (a captured segment's or an execution plan's) is "
                        f"{held!r}; the step signature missed a shape", subject=name)
                t = held
            else:
                t = rt.empty(spec.shape, spec.dtype, name=name or f"{info.name}:unused")
                temps.append(t)
            outs.append(t)
            if name:
                env[name] = Value(t, spec)
        self._launch(step, call, outs, [v.tensor for v in values if v is not None], specs)

    @staticmethod
    def _fresh_checks(run: "Run", step: _Step, checks: tuple) -> tuple:
        """``checks`` less those a node of the same op type already launched in this run on the same
        value with the same bounds and the same-named ``by`` inputs (``IndexCheck.by``: then the
        bounds are equal in every run, so a recorded or captured step that skips one is covered by
        the earlier node's check, which a replay runs too, or by a fresh step's that launched it)."""
        keep = []
        for c in checks:
            if c.by is None:
                keep.append(c)
                continue
            key = (step.info.op_type, step.info.domain, step.inputs[c.input], c.lo, c.hi, c.ignore,
                   tuple(step.inputs[i] for i in c.by))
            if key not in run.checked:
                run.checked.add(key)
                keep.append(c)
        return tuple(keep)

    def _launch(self, step: _Step, call: NodeInfo, outs: list[Tensor], ins: list[Tensor],
                specs: "list[Spec | None] | None", workspace: int | None = None, *,
                record: bool = False, replay: "Relaunch | None" = None) -> "Relaunch | None":
        """Launch a node's kernel on its outputs and inputs (paged weights made resident, the
        kernel's workspace checked against the budget first), then the per-op synchronisation point.
        ``record``: through ``Runtime.launch_recorded``, returning its ``Relaunch`` (or None);
        ``replay``: that ``Relaunch`` enqueued again instead of the kernel's body (launch replay)."""
        rt = self.runtime
        if self.pager is not None:
            self.pager.ensure(self.paged_inputs.get(call.name, ()))
        if step.kernel.workspace is not None:  # temporaries the kernel body allocates, within the budget
            nbytes = workspace if workspace is not None else step.kernel.workspace(call, specs)
            rt.check_allocation(nbytes, f"{call.name}:workspace", "(kernel temporaries)")
        if replay is not None:
            rt.relaunch(replay)
        else:
            go = rt.launch_recorded if record else rt.launch
            if call.index_checks:
                replay = go(step.launch, *outs, *ins, rt.error_latch, node=call, site=rt.latch_site(call.name))
            else:
                replay = go(step.launch, *outs, *ins, node=call)
        if not rt.is_capturing:
            # A runtime's per-op synchronisation point (as in the runtimes of the seeds): a counted
            # no-op under eager-sync deferral, a real drain without it; never inside a capture.
            rt.synchronize()
        return replay

    FOLD_LIMIT = 1024  # elements: shape arithmetic, not data

    def _fold_weight_transposes(self, steps: list[_Step], inits: set[str]) -> tuple[list[_Step], tuple[str, ...]]:
        """``steps`` without each standard-domain Transpose whose input is an initializer and whose
        output is no graph output: its output becomes a constant, transposed once here (the same
        values: a transpose moves bytes, it computes nothing). Returns (steps, the folded nodes)."""
        kept, folded = [], []
        for st in steps:
            info = st.info
            if (st.kernel is not None and info.op_type == "Transpose" and info.domain == "" and st.inputs
                    and st.inputs[0] in inits and st.outputs[0] not in self.outputs and len(st.outputs) == 1):
                w = np.asarray(self._constants[st.inputs[0]])
                perm = info.attr("perm")
                perm = tuple(range(w.ndim))[::-1] if perm is None else tuple(int(p) for p in perm)
                if sorted(perm) == list(range(w.ndim)):  # a bad perm is left to the kernel's own error
                    self._constants[st.outputs[0]] = np.ascontiguousarray(np.transpose(w, perm))
                    folded.append(info.name)
                    continue
            kept.append(st)
        return kept, tuple(folded)

    def _fold_host_values(self, step: _Step, info: NodeInfo, specs: list[Spec | None], out_specs: list[Spec]) -> list[Spec]:
        """When every input's value is known on the host and the outputs are small (shape
        arithmetic: Shape -> Gather -> Range ...), compute the outputs' host values with the same
        kernel body on numpy, so a later node that needs them (``host_inputs``) reads no device
        memory. The device still computes them; this only saves readbacks (host seams)."""
        present = False
        for sp in specs:  # (a plain loop: most nodes have an input the host does not know, and leave here)
            if sp is not None:
                if sp.value is None:
                    return out_specs
                present = True
        if not present or step.kernel.capture != "safe" or all(o.value is not None for o in out_specs):
            return out_specs
        if any(math.prod(o.shape) > self.FOLD_LIMIT for o in out_specs):  # Python ints: no int64 wrap
            return out_specs
        host = {i: specs[i].value for i in step.kernel.host_inputs if i < len(specs) and specs[i] is not None}
        call = info.for_run(tuple(out_specs), host)
        try:
            results = step.kernel.compute(np, call, *[sp.value if sp is not None else None for sp in specs])
        except Exception:
            return out_specs  # folding is an optimisation; the device run reports real errors
        folded = []
        for o, r in zip(out_specs, results):
            r = np.asarray(r)
            folded.append(Spec(o.shape, o.dtype, r.astype(o.dtype)) if r.shape == tuple(o.shape) else o)
        return folded + out_specs[len(folded):]

    def _check_in_place(self, feeds: dict[str, Any], bind: dict[str, Tensor]) -> None:
        fed = {}  # device feeds by identity: the ones an output may be bound over
        if bind:
            for name, value in feeds.items():
                if isinstance(value, Tensor):
                    fed.setdefault(id(value), []).append(name)
        for out, t in bind.items():
            if not isinstance(t, Tensor) or t.runtime is not self.runtime or t.freed:
                raise FeedError(f"output {out!r}: bind needs a live device Tensor of this runtime, got {t!r}")
            unsafe = self._unsafe_over.get(out)
            if unsafe is None:
                unsafe = self._unsafe_binds(out)
            for name in fed.get(id(t), ()):
                if name in unsafe:
                    raise FeedError(f"binding {out!r} in place over feed {name!r} is unsafe: a later node reads {name!r}")

    def _unsafe_binds(self, out: str) -> frozenset[str]:
        """The inputs that ``out`` may not be bound in place over (a node after its producer reads
        them); ``FeedError`` if no kernel produces ``out``. Memoised: it depends on the graph only."""
        producer = self._producer.get(out)
        if producer is None or (self.steps[producer].kernel is None and self.steps[producer].control is None):
            raise FeedError(f"output {out!r} is not produced by a kernel; it cannot be bound")
        unsafe = self._unsafe_over[out] = frozenset(
            vi.name for vi in self.inputs if any(i > producer for i in self._readers.get(vi.name, ())))
        return unsafe


class _BodyExecutor(Executor):
    """An executor over a subgraph: its model is not run through onnx.checker on its own (its
    outer-scope names are inputs without types; the enclosing model's check covered the subgraph),
    and it never plans (each call may bring other shapes)."""

    CHECK_MODEL = False
    FUSE = False

    def __init__(self, model: onnx.ModelProto, runtime: Any, *, registry: Any):
        super().__init__(model, runtime, registry=registry)
        self.plans = None

"""Execution plans: a step signature's shape inference, kernels and buffers, worked out once.

A real runtime does not infer shapes, look up kernels and allocate node by node on every step of a
decode loop: ONNX Runtime plans memory per shape signature and replays a prepared node list. The
executor does the same (``RuntimeConfig.execution_plans``, on by default):

- the *step signature* of a run is its feeds' names, dtypes and shapes, with the dims that grow
  with the KV length masked (``capture_plan.growing_symbols``: the same classifier the capture plan
  uses), so every decode step of a growing cache has one signature;
- the first run of a signature runs node by node (``Executor.step``) and records each node's output
  specs (with the host values the executor folds) and launch arguments; the next run of that
  signature builds a ``StepPlan`` from the record and every later run follows it;
- a plan node is *static* when its shapes and folded values are fixed by the signature: the nodes
  the capture plan would admit or refuse for a kernel reason. The rest (a node whose shapes grow
  with the cache, a host read of device data, an unresolved shape, host control flow) are
  *dynamic*: they run through ``Executor.step`` every time, as before;
- memory planning: each static node's intermediate outputs get a buffer allocated once per plan
  (graph outputs stay per run: bound, kept or downloaded as the caller asked), and a static
  Reshape/Squeeze/Unsqueeze/Flatten of a planned buffer is a view built once. Reusing a buffer on
  the next step is safe because every kernel runs on the runtime's one in-order compute stream; a
  host feed is written into a buffer of its plan (``Runtime.write``: ordered after the queued
  kernels that read the previous step's);
- a step is then a loop of launches: no inference, no allocation, no frees;
- launch replay (``RuntimeConfig.launch_replay``, on by default): the first planned run of a static
  node launches it through ``Runtime.launch_recorded``; later runs that hand the node the very same
  tensors (planned buffers, constants, the same bound feeds and outputs: compared by identity)
  ``Runtime.relaunch`` the record, skipping the kernel's host code (argument checks, launch
  geometry, packing). On CuPy a record exists only when the body's device work was RawKernel
  launches alone (``kernels._launch.LaunchRecorder``); otherwise, or when the tensors differ, the node
  runs its body as before (recorded again on the next run only when the old record had served
  ``StepPlan.REARM`` relaunches: a cache reallocated per sequence, not tensors new every step). A
  dynamic node's output read by a static node is written into a planned buffer (its shape is
  fixed: the reader is static; ``Executor.step`` refuses another shape with ``IllegalState``), so
  the reader gets the same tensor every step.

The launches, their order and their arguments' shapes are the node-by-node run's, so the bytes
are too (``tests/test_execution_plans.py`` runs both and compares; the simulated device's race
and address checks, sync-debug and the error latch see every launch as before). Not planned:
runs inside a capture or with ``retain`` (captured graphs bake their own intermediates), and
executors with paged weights. At most ``PlanCache.LIMIT`` plans are held per executor (least
recently used dropped, its buffers freed stream-ordered); a plan whose buffers the memory budget
refuses is not built, and that signature keeps running node by node.
"""

from __future__ import annotations

from collections import OrderedDict
from operator import is_
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import MemoryAllocation
from .runtime import Relaunch, Tensor
from .values import Run, Value

if TYPE_CHECKING:  # pragma: no cover
    from .executor import Executor

__all__ = ["PlanCache", "StepPlan", "DYNAMIC_REASONS"]

# Capture-plan seam reasons that make a node's shapes or host values vary under one signature.
DYNAMIC_REASONS = ("host control flow", "host read", "unresolved shape", "classifier")


@dataclass(eq=False)
class _Node:
    index: int
    name: str
    slow: bool = False  # dynamic (or Identity): Executor.step every run
    call: Any = None  # NodeInfo with out_specs, host values and index checks
    ins: tuple[str, ...] = ()
    in_specs: list[Any] = field(default_factory=list)
    outs: list["Tensor"] | None = None  # all outputs in planned buffers: the same tensors every run
    per_run: list[tuple[int, str, Any]] = field(default_factory=list)  # (position, name, spec) allocated per run
    n_out: int = 0
    planned: dict[int, "Tensor"] = field(default_factory=dict)  # position -> planned buffer
    alias: tuple[str, str, Any] | None = None  # (source, output, spec): a view built per run
    workspace: int | None = None
    record: bool = False  # record the launch on the next run (launch replay)
    replay: "Relaunch | None" = None  # the recorded launch, relaunched while the node gets the same tensors
    hits: int = 0  # relaunches of the current record


class StepPlan:
    """The plan of one step signature; ``execute`` runs a started ``Run`` through it."""

    REARM = 4  # relaunches after which a record that stops matching is taken again

    def __init__(self, executor: "Executor", record: dict[int, tuple], dynamic: set[int],
                 feeds: dict[str, Any]):
        ex, rt = executor, executor.runtime
        self.runtime = rt
        self.buffers: list[Tensor] = []  # everything this plan allocated (freed by close)
        self.fixed: dict[str, Value] = {}  # planned buffers and prebuilt views, put in a run's env up front
        self.feed_buffers: dict[str, Tensor] = {}
        self.persist: dict[str, Tensor] = {}  # dynamic nodes' outputs that static nodes read: planned buffers
        self.nodes: list[_Node] = []
        outputs = set(ex.outputs)
        constant = ex._const_values
        try:
            for name, value in feeds.items():
                if not isinstance(value, Tensor):
                    self.feed_buffers[name] = self._alloc(value.shape, value.dtype, f"plan:feed:{name}")
            # A dynamic node's output that a static node (or a static view) reads has the shape the
            # reader was planned with (else the reader would grow too): it gets a planned buffer,
            # which the dynamic node writes every step (Executor.step's ``persist``, which refuses
            # another shape), so the reader sees the same tensor each step and can be relaunched.
            slow = {i for i, step in enumerate(ex.steps) if step.kernel is None or i in dynamic or i not in record}
            read = {n for i, step in enumerate(ex.steps) if i not in slow for n in step.inputs if n}
            for i in sorted(slow):
                if ex.steps[i].kernel is None or i not in record:
                    continue
                for name, spec in zip(ex.steps[i].outputs, record[i][0]):
                    if name and name in read and name not in outputs:
                        self.persist[name] = t = self._alloc(spec.shape, spec.dtype, f"plan:{name}")
                        self.fixed[name] = Value(t, spec)  # (views of it are built once, below)
            for i, step in enumerate(ex.steps):
                pn = _Node(i, step.info.name)
                self.nodes.append(pn)
                if i in slow:
                    pn.slow = True
                    continue
                out_specs, call, in_specs = record[i]
                if step.is_view(in_specs[0] if in_specs else None):
                    src, out, spec = step.inputs[0], step.outputs[0], out_specs[0]
                    base = self.fixed.get(src) or constant.get(src)
                    if base is not None:  # a view of a planned buffer or a constant: built once
                        t = base.tensor
                        self.fixed[out] = Value(rt.wrap(t.ref.buffer, spec.shape, spec.dtype, offset=t.ref.offset,
                                                         name=out), spec)
                    else:
                        pn.alias = (src, out, spec)
                    continue
                pn.call, pn.in_specs, pn.n_out = call, in_specs, len(step.outputs)
                pn.ins = tuple(n for n in step.inputs if n)
                for k, (name, spec) in enumerate(zip(step.outputs, out_specs)):
                    if name in outputs:
                        pn.per_run.append((k, name, spec))
                        continue
                    t = self._alloc(spec.shape, spec.dtype, f"plan:{name or step.info.name + ':unused'}")
                    pn.planned[k] = t
                    if name:
                        self.fixed[name] = Value(t, spec)
                if not pn.per_run:
                    pn.outs = [pn.planned[k] for k in range(pn.n_out)]
                if step.kernel.workspace is not None:
                    pn.workspace = step.kernel.workspace(call, in_specs)
                pn.record = rt.config.launch_replay
                if call.index_checks:
                    rt.latch_site(call.name)  # registered now: the launch's lookup is then a dict hit
        except BaseException:
            self.close()
            raise

    def _alloc(self, shape, dtype, name: str) -> "Tensor":
        t = self.runtime.empty(shape, dtype, name=name)
        self.buffers.append(t)
        return t

    def execute(self, ex: "Executor", run: "Run") -> None:
        """Run every node of ``run`` (started with this plan's feed buffers) through the plan."""
        from lockstep.errors import FeedError

        rt = ex.runtime
        env, bind, temps = run.env, run.bind, run.temps
        env.update(self.fixed)
        steps = ex.steps
        for pn in self.nodes:
            if pn.slow:
                ex.step(run, pn.index, persist=self.persist)
                continue
            if pn.call is None:  # a view
                if pn.alias is not None:
                    src, out, spec = pn.alias
                    t = env[src].tensor
                    env[out] = Value(rt.wrap(t.ref.buffer, spec.shape, spec.dtype, offset=t.ref.offset, name=out),
                                      spec)
                continue
            rt.current_node = pn.name
            outs = pn.outs
            if outs is None:
                outs = [None] * pn.n_out  # type: ignore[list-item]
                for k, t in pn.planned.items():
                    outs[k] = t
                for k, name, spec in pn.per_run:
                    t = bind.get(name)
                    if t is not None:
                        if tuple(t.shape) != tuple(spec.shape) or t.dtype != spec.dtype:
                            raise FeedError(f"output {name!r} is bound to {t!r} but is {spec.dtype}{list(spec.shape)}")
                    else:
                        t = rt.empty(spec.shape, spec.dtype, name=name)
                        temps.append(t)
                    outs[k] = t
                    env[name] = Value(t, spec)
            ins = [env[n].tensor for n in pn.ins]
            rep = pn.replay
            if rep is not None:
                if all(map(is_, rep.tensors, (*outs, *ins))):  # the very tensors it was recorded on
                    ex._launch(steps[pn.index], pn.call, outs, ins, pn.in_specs, pn.workspace, replay=rep)
                    pn.hits += 1
                    continue
                # Other tensors now (a new feed, a fresh output): the body runs. A record that served
                # a while (a cache reallocated per sequence) is taken again on the next run; one that
                # keeps missing (tensors new every step) is not: recording costs more than it saves.
                pn.replay, pn.record, pn.hits = None, pn.hits >= self.REARM, 0
            elif pn.record:
                pn.record = False
                pn.replay = ex._launch(steps[pn.index], pn.call, outs, ins, pn.in_specs, pn.workspace, record=True)
                continue
            ex._launch(steps[pn.index], pn.call, outs, ins, pn.in_specs, pn.workspace)

    @property
    def replays(self) -> int:
        """Nodes that relaunch a recorded launch (a counter for tests and the benchmark)."""
        return sum(pn.replay is not None for pn in self.nodes)

    def close(self) -> None:
        """Free the plan's buffers (stream-ordered: a queued step still reading them is waited for)
        and drop its launch records (on CuPy they hold views of the buffers they name)."""
        for pn in self.nodes:
            pn.replay = None
        for t in self.buffers:
            if not t.freed:
                self.runtime.free(t)
        self.buffers.clear()
        self.fixed.clear()
        self.feed_buffers.clear()
        self.persist.clear()


class PlanCache:
    """An executor's plans by step signature (see the module docstring)."""

    LIMIT = 4

    def __init__(self, executor: "Executor"):
        self.ex = executor
        self._growing: set | None = None
        self._masks: dict[str, frozenset[int]] = {}  # per feed: the positions of its growing dims
        self._dynamic: set[int] | None = None
        self._first: tuple[tuple, dict[int, tuple]] | None = None  # (raw signature, record) of the first run
        self._records: dict[tuple, dict[int, tuple]] = {}
        self._plans: OrderedDict[tuple, StepPlan] = OrderedDict()
        self._refused: set[tuple] = set()
        self.built = 0  # plans built (a counter for tests and the benchmark)
        self.planned_runs = 0  # runs that followed a plan

    @staticmethod
    def _raw(feeds: dict[str, Any]) -> tuple:
        return tuple((name, tuple(int(d) for d in feeds[name].shape), feeds[name].dtype) for name in sorted(feeds))

    def _key(self, raw: tuple) -> tuple:
        """The step signature: ``raw`` with the dims that grow with the KV length masked."""
        if self._growing is None:
            from .capture_plan import growing_symbols
            from .symbols import Symbol

            self._growing = growing_symbols(self.ex)
            self._masks = {name: frozenset(k for k, d in enumerate(dims) if isinstance(d, Symbol) and d in self._growing)
                           for name, dims in self.ex.symbolic_shapes.items()}
        masks = self._masks
        out = []
        for name, shape, dtype in raw:
            m = masks.get(name)
            out.append((name, tuple("*" if k in m else n for k, n in enumerate(shape)) if m else shape, dtype))
        return tuple(out)

    def _dynamic_steps(self) -> set[int]:
        if self._dynamic is None:
            from .capture_plan import plan_capture

            decisions = plan_capture(self.ex).decisions  # one per step, in order
            self._dynamic = {i for i, (_, reason) in enumerate(decisions)
                             if reason is not None and reason.split(":")[0] in DYNAMIC_REASONS}
        return self._dynamic

    def lookup(self, feeds: dict[str, Any]) -> StepPlan | None:
        """The plan for this run's signature: built from a recorded run of it on first need."""
        if self._first is None and not self._records and not self._plans:
            return None  # the executor's first run: nothing recorded yet (no analysis spent on one-shot runs)
        if self._first is not None:
            raw, record = self._first
            self._first = None
            self._records[self._key(raw)] = record
        key = self._key(self._raw(feeds))
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            self.planned_runs += 1
            return plan
        record = self._records.pop(key, None)
        if record is None or key in self._refused:
            return None
        try:
            plan = StepPlan(self.ex, record, self._dynamic_steps(), feeds)
        except MemoryAllocation:
            self._refused.add(key)  # the budget cannot hold its buffers: this signature runs node by node
            return None
        self._plans[key] = plan
        self.built += 1
        while len(self._plans) > self.LIMIT:
            _, old = self._plans.popitem(last=False)
            old.close()
        self.planned_runs += 1
        return plan

    def remember(self, feeds: dict[str, Any], record: dict[int, tuple]) -> None:
        """Keep a node-by-node run's record, to build its signature's plan when it comes again."""
        if self._first is None and not self._records and not self._plans:
            self._first = (self._raw(feeds), record)
            return
        if self._first is not None:
            raw, first = self._first
            self._first = None
            self._records[self._key(raw)] = first
        self._records[self._key(self._raw(feeds))] = record
        while len(self._records) > 2 * self.LIMIT:
            self._records.pop(next(iter(self._records)))

    def close(self) -> None:
        for plan in self._plans.values():
            plan.close()
        self._plans.clear()
        self._records.clear()
        self._first = None

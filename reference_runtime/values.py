"""The values of one graph execution, shared by the executor and what runs beside it (control flow,
host values, execution plans, capture segments): ``Value``, a tensor value (a device tensor, or a
string tensor held on the host), and ``Run``, one execution of a graph (``Executor.start``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lockstep.kernels import Spec

from .runtime import Tensor

__all__ = ["Run", "Value"]


@dataclass(slots=True)
class Value:
    """A tensor value of a run: a device tensor, or (``tensor=None``) a string tensor held on the
    host in ``spec.value``. Sequences and optionals are other entries (``host_values``)."""

    tensor: Tensor | None
    spec: Spec


@dataclass(eq=False)
class Run:
    """One execution of the graph (``Executor.start``): the values so far (name -> device tensor
    and spec), the temporaries it allocated, and the outputs the caller keeps or binds."""

    env: dict[str, Value]
    temps: list[Tensor]
    keep: frozenset[str]
    bind: dict[str, Tensor]
    handed: set[int] = dataclasses.field(default_factory=set)  # temporaries given to the caller
    record: dict[int, tuple] | None = None  # step -> (out_specs, call): what a plan is built from
    checked: set[tuple] = dataclasses.field(default_factory=set)  # index checks launched (``IndexCheck.by``)

"""Host kernels: ONNX operators on values that are not device tensors.

Sequences, optionals and string tensors never live in device memory:

- a *sequence* is a ``Seq``: a host-side tuple of tensor values (each one a device tensor the
  executor owns) and its element type;
- an *optional* is either empty (``None``) or the value it holds (a tensor value or a ``Seq``), as
  in ONNX's reference evaluator;
- a *string tensor* is a tensor value whose data is a numpy object array held on the host.

An operator on them is an ``OpKernel`` built by ``HostOp``: ``run(ctx, node, *values) -> outputs``
runs on the host between launches, so it is a capture seam (``capture="unsupported"``). ``values``
are the node's inputs (``None`` where absent or an empty optional); a tensor value has ``.spec``
(``Spec``: shape, dtype, host value where known). The context ``ctx`` (the executor's
``reference_runtime.host_values.HostContext``) gives:

- ``ctx.read(v) -> np.ndarray``: a tensor value on the host (a device-to-host read: the node's host
  seam; a string tensor or host-known value without one);
- ``ctx.tensor(array) -> value``: a new tensor value holding a host array (uploaded; a string
  array stays on the host);
- ``ctx.launch(fn, out_specs, *values) -> [value, ...]``: new device tensors of ``out_specs``
  computed on the device by ``fn(xp, *arrays) -> tuple`` (the ``xp`` rules of kernels/README.md).

Outputs are tensor values, ``Seq``s, or ``None`` (an empty optional). A ``Seq`` may hold the very
tensor values it was given (no copy): values are immutable once produced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ._op import NodeInfo, OpKernel, Spec

__all__ = ["Seq", "HostOp", "host_only"]


@dataclass(frozen=True)
class Seq:
    """A sequence value: tensor values on a host-side tuple, and the element type (for an empty one)."""

    items: tuple[Any, ...]
    dtype: np.dtype

    def __len__(self) -> int:
        return len(self.items)


def host_only(node: NodeInfo, specs: list[Spec | None]) -> list[Spec]:
    """A host kernel's ``shapes``/``compute``: the executor runs ``OpKernel.host`` instead, so
    reaching this is the executor's bug, named."""
    raise node.error("a host kernel was asked for device shapes or a device compute (it runs through OpKernel.host)")


def HostOp(op_type: str, run: Callable[..., tuple[Any, ...]], *, reason: str = "", **kw: Any) -> OpKernel:
    """An operator run on the host (see the module docstring): a capture seam."""
    why = reason or f"{op_type} runs on the host (sequences, optionals, strings): a capture seam"
    return OpKernel(op_type, host_only, host_only, capture="unsupported", reason=why, host=run, **kw)

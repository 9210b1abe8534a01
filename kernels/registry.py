"""The kernel registry: every ONNX op kernel, validated when this module is imported.

Op modules are listed explicitly in ``MODULES``; each exposes ``OPS``, a list of ``OpKernel``.
Import fails loudly, naming the offending definition, on: a module without ``OPS``, an entry that is
not an ``OpKernel``, two kernels of one (domain, op) with overlapping opset ranges, or a non-safe
capture declaration without a reason (checked by ``OpKernel`` itself).

Adding an op: write it in the module of its family (or a new module listed here) and append it to
that module's ``OPS``; its node-suite cases then run on every reference engine.
"""

from __future__ import annotations

import importlib

from ._op import OpKernel

__all__ = ["Registry", "REGISTRY", "MODULES", "EXECUTOR_OPS"]

MODULES = (
    "lockstep.kernels.ops_elementwise",
    "lockstep.kernels.ops_conv",
    "lockstep.kernels.ops_resize",
    "lockstep.kernels.ops_signal",
    "lockstep.kernels.ops_shape",
    "lockstep.kernels.ops_index",
    "lockstep.kernels.ops_reduce",
    "lockstep.kernels.ops_nn",
    "lockstep.kernels.ops_linalg",
    "lockstep.kernels.ops_cast",
    "lockstep.kernels.ops_contrib",
    "lockstep.kernels.ops_contrib_attention",
    "lockstep.kernels.ops_contrib_gqa",
    "lockstep.kernels.ops_rnn",
    "lockstep.kernels.ops_roi",
    "lockstep.kernels.ops_conv_variants",
    "lockstep.kernels.ops_detection",
    "lockstep.kernels.ops_sequence",
    "lockstep.kernels.ops_string",
    "lockstep.kernels.ops_ml",
    "lockstep.kernels.ops_training",
    "lockstep.kernels.ops_text",
    "lockstep.kernels.ops_image",
    "lockstep.kernels.ops_random",
)

# Ops the executor handles itself rather than through a kernel.
EXECUTOR_OPS = {("", "Constant"), ("", "Identity")}


class Registry:
    def __init__(self, kernels: list[OpKernel]):
        self._by_op: dict[tuple[str, str], list[OpKernel]] = {}
        for k in kernels:
            if not isinstance(k, OpKernel):
                raise TypeError(f"registry entry {k!r} is not an OpKernel")
            domain = "" if k.domain in ("", "ai.onnx") else k.domain
            same = self._by_op.setdefault((domain, k.op_type), [])
            for other in same:
                hi_a = k.until if k.until is not None else 10**9
                hi_b = other.until if other.until is not None else 10**9
                if k.since <= hi_b and other.since <= hi_a:
                    raise ValueError(f"duplicate kernels for {domain or 'ai.onnx'}::{k.op_type}: {other!r} and {k!r} overlap")
            same.append(k)

    @classmethod
    def from_modules(cls, modules: tuple[str, ...] = MODULES) -> "Registry":
        kernels: list[OpKernel] = []
        for name in modules:
            mod = importlib.import_module(name)
            ops = getattr(mod, "OPS", None)
            if ops is None:
                raise ImportError(f"kernel module {name} defines no OPS list")
            kernels.extend(ops)
        return cls(kernels)

    def lookup(self, domain: str, op_type: str, opset: int) -> OpKernel | None:
        domain = "" if domain in ("", "ai.onnx") else domain
        for k in self._by_op.get((domain, op_type), ()):
            if k.covers(opset):
                return k
        return None

    def why_not(self, domain: str, op_type: str, opset: int) -> str:
        domain = "" if domain in ("", "ai.onnx") else domain
        have = self._by_op.get((domain, op_type))
        if not have:
            return f"no kernel for {domain or 'ai.onnx'}::{op_type}"
        ranges = ", ".join(f"{k.since}-{k.until or ''}" for k in have)
        return f"no kernel for {domain or 'ai.onnx'}::{op_type} at opset {opset} (have {ranges})"

    def ops(self) -> list[tuple[str, str]]:
        return sorted(self._by_op)


REGISTRY = Registry.from_modules()

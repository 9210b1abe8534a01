"""The root of lockstep's named errors, and the ground floor's own.

Every error lockstep raises on purpose -- a bad model, bad input, a refused device operation, an
engine it cannot load, a golden snapshot it cannot use -- is a ``LockstepError`` (each keeps the
builtin base its callers catch: ``ValueError``, ``RuntimeError``, ``NotImplementedError``). The CLI
prints one as one line naming its class (anything else is a bug and keeps its traceback); the
fuzzer counts one as ``named`` (anything else is a crash). Modules on every floor import the root
from here; nothing here imports the rest of lockstep.
"""

from __future__ import annotations

__all__ = ["LockstepError", "FeedError", "ModelError", "command_parser"]


class LockstepError(Exception):
    """An error lockstep names: its message says what was wrong and where."""


class ModelError(LockstepError, ValueError):
    """The model is malformed, fails the checker, or references data it must not (raised by
    ``lockstep.loading`` and its shape-inference guard, ``lockstep.inference``)."""


class FeedError(LockstepError, ValueError):
    """A feed is missing, unknown, or of the wrong dtype or shape; names the input (any engine's
    session: the reference runtime's executor, ONNX Runtime's refusal of a step's feeds)."""


def command_parser(prog: str, **kwargs):
    """The argument parser of a ``lockstep`` subcommand whose module parses its own arguments
    (``lockstep expectations``, ``fuzz``, ``cases``, ``capture-guard``): a usage error is one
    ``PROG: error: ...`` line, exit status 2, like the CLI's own (argparse's default adds the usage)."""
    import argparse

    class _OneLine(argparse.ArgumentParser):
        def error(self, message):
            self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")

    return _OneLine(prog=prog, **kwargs)


def type_name(elem_type: object) -> str:
    """An ONNX tensor element type, named for a message: ``FLOAT``, or ``elem_type -3 (not an ONNX
    type)`` for a code outside onnx's table. Never raises: a user's model may hold any integer."""
    try:
        from onnx import TensorProto

        return TensorProto.DataType.Name(int(elem_type)) if int(elem_type) else "untyped"
    except Exception:  # noqa: BLE001 - a message about a bad value must not fail on it
        return f"elem_type {elem_type!r} (not an ONNX type)"

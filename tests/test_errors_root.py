"""Every error lockstep names is a ``LockstepError``; the CLI prints one as one line and lets anything
else keep its traceback."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from lockstep.decoder_io import NotADecoder
from lockstep.engines import EngineLoadError, Unsupported
from lockstep.errors import FeedError, LockstepError
from lockstep.golden.catalog import GoldenError
from lockstep.golden.text import TokenizerError
from lockstep.kernels._kernel import KernelHostError
from lockstep.kernels._op import OpError
from lockstep.loading import ModelError
from lockstep.reference_runtime import errors as e

# the builtin bases their callers catch, kept
BASES = {ModelError: ValueError, FeedError: ValueError, OpError: ValueError, NotADecoder: ValueError,
         Unsupported: NotImplementedError, e.CudaError: RuntimeError, EngineLoadError: RuntimeError,
         GoldenError: ValueError}
PACKAGES = ("lockstep", "lockstep.reference_runtime", "lockstep.kernels", "lockstep.golden", "lockstep.contracts",
            "lockstep.conformance")


def _named_errors() -> list[type]:
    """Every exception class a lockstep module defines (warnings aside), found by importing each module
    of every package (the test suites' modules aside): a new one cannot be forgotten."""
    found = []
    for top in PACKAGES:
        for info in pkgutil.walk_packages(importlib.import_module(top).__path__, top + "."):
            leaf = info.name.rsplit(".", 1)[-1]
            if ".suite" in info.name or leaf.startswith("test_") or leaf == "__main__":
                continue
            mod = importlib.import_module(info.name)
            found += [obj for obj in vars(mod).values() if inspect.isclass(obj) and issubclass(obj, BaseException)
                      and not issubclass(obj, Warning) and obj.__module__ == info.name]
    return sorted(set(found), key=lambda c: f"{c.__module__}.{c.__qualname__}")


NAMED = _named_errors()


def test_the_discovery_finds_the_named_errors():
    # result: not vacuous: the errors of every floor are found (40 at the time of writing)
    assert len(NAMED) >= 40 and {ModelError, GoldenError, e.DeviceAssert, KernelHostError, TokenizerError} <= set(NAMED)


@pytest.mark.parametrize("cls", NAMED, ids=lambda c: f"{c.__module__.removeprefix('lockstep.')}.{c.__name__}")
def test_a_named_error_is_a_lockstep_error(cls):
    # contract: one root for every named error (the CLI and the fuzzer catch it), the builtin base kept
    assert issubclass(cls, LockstepError), f"{cls.__module__}.{cls.__qualname__} is not a LockstepError"
    if cls in BASES:
        assert issubclass(cls, BASES[cls])


def test_the_cli_prints_a_lockstep_error_as_one_line_and_lets_a_bug_keep_its_traceback(monkeypatch, capsys):
    # contract: a LockstepError from any command is one line naming its class, rc 2; another exception
    # propagates (a bug in lockstep keeps its traceback)
    from lockstep.conformance import cli

    def boom(exc):
        def run(_args):
            raise exc
        return run

    monkeypatch.setattr(cli, "_parity", boom(GoldenError("snapshot x.json: not JSON\nline 2")))
    assert cli.main(["parity"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "lockstep: error: GoldenError: snapshot x.json: not JSON; line 2"
    monkeypatch.setattr(cli, "_parity", boom(ZeroDivisionError("a bug")))
    with pytest.raises(ZeroDivisionError):
        cli.main(["parity"])

"""Every error lockstep names is a ``LockstepError``; the CLI prints one as one line and lets anything
else keep its traceback."""

from __future__ import annotations

import pytest

from lockstep.decoder_io import ContextLimitExceeded, KVCacheTooLarge, ModelCardError, NotADecoder, StepError
from lockstep.engines import EngineLoadError, Unsupported
from lockstep.errors import FeedError, LockstepError
from lockstep.golden.catalog import GoldenError
from lockstep.golden.text import TokenizerError
from lockstep.kernels._kernel import KernelHostError
from lockstep.kernels._op import OpError
from lockstep.loading import ModelError, UnsupportedModel
from lockstep.reference_runtime import errors as e

# the named errors the CLI printed as one line and the fuzzer counted as named before they had a root
NAMED = [ModelError, UnsupportedModel, Unsupported, FeedError, OpError, KernelHostError, e.CudaError,
         e.MemoryAllocation, e.DeviceAssert, e.LaunchFailure, e.CaptureD2HRefused, e.CaptureOnLegacyStream,
         e.CublasDuringCapture, e.CaptureUnmodelled, e.SyncDebugError, StepError, ContextLimitExceeded,
         NotADecoder, KVCacheTooLarge, ModelCardError, TokenizerError, GoldenError, EngineLoadError]
# the builtin bases their callers catch, kept
BASES = {ModelError: ValueError, FeedError: ValueError, OpError: ValueError, NotADecoder: ValueError,
         Unsupported: NotImplementedError, e.CudaError: RuntimeError, EngineLoadError: RuntimeError}


@pytest.mark.parametrize("cls", NAMED, ids=lambda c: c.__name__)
def test_a_named_error_is_a_lockstep_error(cls):
    # contract: one root for every named error (the CLI and the fuzzer catch it), the builtin base kept
    assert issubclass(cls, LockstepError)
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

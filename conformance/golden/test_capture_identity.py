"""Capture on/off byte identity on every golden model: ``pytest conformance/ -m capture``.

The same decode through the same engine, once with its graph capture off and once on
(``engine.decoder(model, capture=...)``; an engine without capture, or whose capture cannot take
this model, is a skip with its reason). The token ids and the bytes of every step's logits must be
identical; a failure names the first step that diverged, after how many replays, both tokens and
the max |logit difference| there, and the command that locates the node
(``lockstep locate MODEL --engine E --position P --session capture``). Each run proves which path it took through the session's
``capture_stats()``: the "on" run captured at least one graph, replayed, and never fell back to
eager; the "off" run captured and replayed nothing. So the comparison cannot pass with capture
silently off. Capture is chosen per session, never by a process-wide switch. On the reference
runtime a growing-cache model's captured fraction of nodes (the capture census) is held to its floor
in ``capture_floors.toml`` (``scripts/capture_census.py --write``), so capture identity cannot pass
on a plan that captures almost nothing (SmolLM2 int4 once captured 5 of 773 nodes).

On the reference runtime the counts are exact: with a fixed-capacity cache the one-token step is
one graph in the PRIMARY slot; with a growing cache each step runs as captured segments (one graph
each) and eager seams; after the prefill and one eager warm-up step, every step replays.

``test_speculative_capture_identity``: a speculative decode (``lockstep.decoding.speculative``: a
prompt-lookup draft verified ``VERIFY_WIDTH`` tokens a step, padded to that width, rejected tokens
rewound) with capture on and off gives the same bytes at every call; with a fixed-capacity cache the
reference runtime replays the one-token step from its PRIMARY slot and the verify step from its
VERIFY slot, neither invalidating the other, and never falls back; its tokens are the greedy
decode's (a first difference only where greedy's top two are within the near-tie band). An engine
whose session cannot rewind is a skip with its reason.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest

from lockstep.decoding import VERIFY_WIDTH, first_divergence, greedy, open_session, speculative
from lockstep.engines import Unsupported, precision_of, unsupported_reason
from lockstep.golden.anchors import band_for
from lockstep.engines.protocol import capabilities
from lockstep.engines.registry import spec_of

from ..locate.command import command_line
from .arbiter import model_takes_no_verify_step

TOKENS = 12
# model -> the fraction of its nodes the reference runtime captures at least (scripts/capture_census.py)
CAPTURE_FLOORS: dict[str, float] = tomllib.loads((Path(__file__).parent / "capture_floors.toml").read_text())
SPEC_TOKENS = 16
SPEC_ECHO = 12  # tokens of the recorded continuation repeated in the speculative decode's prompt


@pytest.mark.capture
def test_capture_on_off_byte_identity(engine, golden_model, request):
    proto = golden_model.load()
    io = golden_model.io(proto)
    prompt = golden_model.prompt()
    try:
        on_session = open_session(engine, proto, capture=True, io=io)
    except Unsupported as exc:
        pytest.skip(unsupported_reason(engine.name, exc))
    on = greedy(on_session, prompt, TOKENS)
    off = greedy(open_session(engine, proto, capture=False, io=io), prompt, TOKENS)
    assert on.capture.captures >= 1 and on.capture.replays >= 1, f"contract: capture was really on ({on.capture})"
    assert on.capture.fallbacks == 0, f"contract: no step fell back to eager ({on.capture})"
    assert off.capture.captures == 0 and off.capture.replays == 0, f"contract: capture was really off ({off.capture})"
    if capabilities(engine).runtime_device:  # the reference runtime: its counters are exact
        # prefill, one eager warm-up step, then TOKENS - 2 steps replayed (the first right after its
        # capture): one graph per step with a fixed-capacity cache, one per segment with a growing one
        segments = 1 if io.capacity else on.capture.detail["segments"]
        assert on.capture.captures == segments, "contract: one graph per segment"
        assert on.capture.replays == segments * (TOKENS - 2), "contract: every later step replayed"
        assert on.counters["replays"] == segments * (TOKENS - 2), "contract: the runtime launched those graphs"
        assert off.counters["captures"] == 0 and off.counters["replays"] == 0, "contract: the runtime captured nothing"
        floor = CAPTURE_FLOORS.get(golden_model.name)
        if floor is not None and not io.capacity:  # (a fixed-capacity step is one graph: every node)
            got = on.capture.detail["captured_nodes"] / max(1, on.capture.detail["nodes"])
            assert got >= floor, (
                f"result: the reference runtime captures {got:.1%} of {golden_model.name}'s nodes, under its floor "
                f"{floor:.0%} (conformance/golden/capture_floors.toml; seams {on.capture.detail['seams_by_reason']})")
    assert (div := first_divergence(on, off)) is None, (
        f"result: {_divergence(golden_model.name, div)}; locate the node: {_locate(engine, golden_model, div, request)}")


@pytest.mark.capture
def test_speculative_capture_identity(engine, golden_model):
    proto = golden_model.load()
    io = golden_model.io(proto)
    snap = golden_model.snapshot()
    # repeated text, what a prompt-lookup draft is for: the prompt, the model's own greedy
    # continuation of it (the snapshot's), the prompt again
    echo = SPEC_ECHO
    while echo > 0 and not io.has_room(2 * len(snap["prompt"]) + echo + SPEC_TOKENS + VERIFY_WIDTH):
        echo -= 1  # a small capacity (kv64): less of the continuation repeated
    prompt = list(snap["prompt"]) + list(snap["prefix"][:echo]) + list(snap["prompt"])
    try:
        on_session = open_session(engine, proto, capture=True, io=io)
    except Unsupported as exc:
        pytest.skip(unsupported_reason(engine.name, exc))
    try:
        on = speculative(on_session, prompt, SPEC_TOKENS, io=io)
        off = speculative(open_session(engine, proto, capture=False, io=io), prompt, SPEC_TOKENS, io=io)
    except Unsupported as exc:
        pytest.skip(unsupported_reason(engine.name, exc))
    except Exception as exc:
        why = model_takes_no_verify_step(engine, open_session(engine, proto, io=io), golden_model, snap, exc)
        if why:
            pytest.skip(why)
        raise
    kinds = on.kinds()
    assert kinds.get("verify", 0) >= 1, f"result: the decode verified a draft ({kinds})"
    assert on.capture.fallbacks == 0, f"contract: no step fell back to eager ({on.capture})"
    assert off.capture.captures == 0 and off.capture.replays == 0, f"contract: capture was really off ({off.capture})"
    if capabilities(engine).runtime_device and io.capacity:
        # each width after a past: one eager warm-up call, then its slot's graph every call (the
        # launch right after recording included); decode and verify never take each other's slot
        slots = on.capture.detail["replays_by_slot"]
        expected = {"primary": max(0, kinds.get("decode", 0) - 1), "verify": max(0, kinds.get("verify", 0) - 1)}
        assert slots == expected, f"contract: each width replays from its own slot ({slots}, calls {kinds})"
        assert on.counters["replays_by_slot"] == slots, "contract: the runtime launched the slots' graphs"
    runs = on.capture.detail.get("runs_by_graph_id")
    if runs:  # ONNX Runtime's CUDA graphs: each width after a past under its own graph annotations
        assert runs[3] + runs[4] == kinds.get("verify", 0) and runs[1] + runs[2] == kinds.get("decode", 0), (
            f"contract: every verify step ran under the verify width's graph ids (3, 4), every one-token "
            f"step under 1, 2 ({runs}, calls {kinds})")
    plain = greedy(open_session(engine, proto, capture=False, io=io), prompt, SPEC_TOKENS)
    if off.tokens != plain.tokens:  # a verify step's logits may order a near-tie otherwise: nothing else
        i = next(k for k, (a, b) in enumerate(zip(off.tokens, plain.tokens)) if a != b)
        top = np.sort(np.asarray(plain.step_logits[i], np.float64))[::-1]
        band = band_for(snap, precision_of(engine, golden_model.dtype))
        assert top[0] - top[1] <= band, (
            f"result: the speculative decode of {golden_model.name} leaves the greedy one at token {i} "
            f"({off.tokens[i]} vs {plain.tokens[i]}, greedy margin {top[0] - top[1]:.4g} > band {band:.4g}): "
            f"a rejected draft not forgotten (rewind), or a verify step computed wrong")
    assert [c["kind"] for c in on.calls] == [c["kind"] for c in off.calls] and on.tokens == off.tokens, (
        f"result: capture on and off of {golden_model.name} decode differently: {on.tokens} vs {off.tokens}")
    for i, (a, b) in enumerate(zip(on.calls, off.calls)):
        assert a["logits"].tobytes() == b["logits"].tobytes(), (
            f"result: capture on and off of {golden_model.name} differ at call {i} ({a['kind']}, fed {a['fed']}): "
            f"max |logit difference| {float(abs(a['logits'] - b['logits']).max()):.6g}")


def _locate(engine, golden_model, d: dict, request) -> str:
    """The command that locates the first node the captured step computes out of its band."""
    dirs = request.config.getoption("golden_dir") if golden_model.kind == "user" else []
    args = [golden_model.name, *(a for g in dirs for a in ("--golden-dir", str(g))), "--position", str(d["position"])]
    return command_line(args, spec_of(engine), "capture")


def _divergence(model: str, d: dict) -> str:
    """The first step where the captured decode left the eager one, in words."""
    if d["max_abs_diff"] is None:
        return f"capture on and off of {model} differ at step {d['step']}: {d['why']}"
    replays = "" if d["replays"] is None else f", after {d['replays']} replay(s) of the captured run"
    tokens = (f"token {d['tokens'][0]} with capture on, {d['tokens'][1]} off" if d["tokens"][0] != d["tokens"][1]
              else f"the same token {d['tokens'][0]}, other logits")
    return (f"capture on and off of {model} diverge at step {d['step']} (position {d['position']}{replays}): "
            f"{tokens}; max |logit difference| {d['max_abs_diff']:.6g} at that step; the {d['step']} step(s) "
            f"before it byte-identical")

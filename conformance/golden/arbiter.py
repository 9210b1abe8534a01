"""Whether a model itself refuses a speculative verify step, asked of a second runtime (the golden
verify lock's skip: a model property is a counted skip with its evidence, an engine's bug a failure)."""

from __future__ import annotations

from lockstep.decoding import VERIFY_WIDTH, open_session

__all__ = ["ARBITERS", "model_takes_no_verify_step"]

ARBITERS = ("ort-cpu", "ref-sim")  # second runtimes asked whether a model takes a verify step at all


def model_takes_no_verify_step(engine, session, golden_model, snap, exc: Exception) -> str | None:
    """Why the model itself takes no ``VERIFY_WIDTH``-token step after a past (a skip, counted with
    this reason), or None (the engine's failure stands). Some exports cannot: GenAI's builder writes
    its fp16 CPU models' causal mask for a prefill or a one-token step only (its Expand of the
    [k, k] mask to [k, past + k] fails). Decided by a second runtime running the same first verify
    step (after the engine's own prefill of the prompt ran: a failing prefill is the prefill lock's):
    where it fails too, the model refuses; where it runs, the engine is wrong."""
    from lockstep.engines.registry import load_available

    prompt = list(snap["prompt"])
    context = (prompt + list(snap["prefix"]))[:len(prompt) + VERIFY_WIDTH]
    try:  # the engine's own prefill of the prompt: where that fails, the failure is not the verify step's
        session.reset()
        session.forward(prompt)
    except Exception:  # noqa: BLE001
        return None
    for name in ARBITERS:
        if name == engine.name:
            continue
        try:
            other = load_available(name)
        except Exception:  # noqa: BLE001 - not installed here: the next one, or the failure stands
            continue
        model = golden_model.load()
        try:
            session = open_session(other, model, io=golden_model.io(model))
            session.reset()
            session.forward(prompt)
        except Exception:  # noqa: BLE001 - it cannot even run the prefill: no evidence about the verify step
            continue
        try:
            session.forward(context[len(prompt):])
        except Exception as other_exc:  # noqa: BLE001 - the second runtime's failure is the evidence
            first = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
            second = (str(other_exc).splitlines() or [type(other_exc).__name__])[0][:160]
            return (f"{golden_model.name} takes no {VERIFY_WIDTH}-token step after a past: {engine.name} fails "
                    f"({first}) and so does {name} ({second})")
        return None
    return None

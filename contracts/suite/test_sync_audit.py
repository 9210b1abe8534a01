"""The whole tree passes the sync audit (``lockstep audit``): no synchronising or host-reading call
on a capture path without a dominating guard, a capture-unsupported declaration, or an allowlist
entry with its reason; and no stale allowlist entry. A CI required check, like the rest of
``pytest contracts/suite``."""

from __future__ import annotations

from lockstep.contracts.audit import audit, format_text


def test_the_tree_has_no_capture_unsafe_sync():
    res = audit()
    assert res.clean, "result: the audit found\n" + format_text(res, explain=False)
    # not vacuous: it found the kernels and the runtime's capture paths, and judged real sync sites
    assert len(res.entries) > 100 and any(e.startswith("runtime ") for e in res.entries)
    assert any(s.status == "guarded" for s in res.sites) and any(s.status == "allowlisted" for s in res.sites)

"""Host tables an op builds once per node from its attributes (TreeEnsemble's trees, TfIdfVectorizer's
n-gram pool), kept for the runs that follow.

``node_plan(node, build)`` returns ``build(node)``, built on the first call for that node's attribute
dict (the executor's ``NodeInfo.attrs`` is one dict per loaded node, shared by every run of it) and
reused after. The kernel's load-time ``check`` calls it, so a bad table is an ``OpError`` when the
model loads and a run finds it already built. The cache holds at most ``_KEEP`` nodes (oldest
dropped, rebuilt on demand) and keeps each entry's attribute dict alive, so an id is never reused
while its entry stands.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

from ._op import NodeInfo

__all__ = ["node_plan"]

_KEEP = 256
_PLANS: "OrderedDict[tuple[int, str], tuple[dict, Any]]" = OrderedDict()


def node_plan(node: NodeInfo, build: Callable[[NodeInfo], Any]) -> Any:
    key = (id(node.attrs), build.__qualname__)
    hit = _PLANS.get(key)
    if hit is not None and hit[0] is node.attrs:
        _PLANS.move_to_end(key)
        return hit[1]
    plan = build(node)
    _PLANS[key] = (node.attrs, plan)
    while len(_PLANS) > _KEEP:
        _PLANS.popitem(last=False)
    return plan

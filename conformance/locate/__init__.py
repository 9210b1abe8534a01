"""``lockstep locate``: the first node of a model whose value on an engine leaves its error band,
and the minimal failing subgraph as a node case (``--reduce``). ``subject`` resolves what runs,
``search`` finds the node (values exposed as outputs, or bisection), ``runs`` runs the engine (``prepare``,
or a decoder's prefill in its own decode session), ``failure`` locates an engine that raises at the node
its error names, ``session`` finds it through an engine's decode session (eager, or with its graph
capture), ``judge`` holds the bands, ``reduce`` writes the case, ``command`` is the CLI."""

from .judge import Judged, first_divergence
from .oracle import LocateError
from .search import Located, locate
from .session import locate_in_session
from .subject import Subject, subject

__all__ = ["Judged", "Located", "LocateError", "Subject", "first_divergence", "locate", "locate_in_session",
           "subject"]

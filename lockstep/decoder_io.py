"""Which input and output of a decoder-only ONNX LLM plays which role, read from the graph.

Three conventions are recognised from names, ranks and shapes:

- Hugging Face Optimum / transformers.js: ``input_ids``, ``attention_mask``, optional
  ``position_ids``, optional extras (``num_logits_to_keep``, ``logits_to_keep``, ``cache_position``),
  ``past_key_values.{l}.key|value`` -> ``logits``, ``present.{l}.key|value`` (or
  ``present_key_values.{l}.key|value``);
- ONNX Runtime GenAI: the same names without ``position_ids`` (GroupQueryAttention derives
  positions from the mask inside the graph), past/present in BNSH;
- lockstep's own golden models: ``input_ids``, ``position_ids``, past/present, no mask.

The KV layout (batch, kv heads, sequence, head size) and the growing axis come from the graph:
the sequence axis of a past input is its symbolic non-batch axis; a cache with no symbolic axis has
a fixed capacity and its sequence axis is the one the attention op reads (axis 2, BNSH, unless a
model card says otherwise). When detection is ambiguous or fails, ``NotADecoder`` lists what was
found and how to say it explicitly: a model card (``<model>.lockstep.toml`` next to the model, or
``--io role=name,...``) mapping roles to names::

    [io]
    input_ids = "tokens"
    attention_mask = "mask"            # optional; "" says the model has none
    position_ids = "positions"         # optional; "" says the model has none
    logits = "scores"
    past = "cache.{layer}.{kind}"      # {layer} 0.., {kind} key|value
    present = "next_cache.{layer}.{kind}"
    kv_layout = "BNSH"                 # or "BSNH"
    head_size = 64                     # when the past inputs leave it symbolic
    kv_capacity = 4096                 # a shared past/present buffer of this many positions

``genai_config.json`` beside the model (ONNX Runtime GenAI's builder writes it) is read as the
lowest layer of the card (``lockstep.genai_config``): names, head size, shared-buffer capacity.

Window-sized caches: a past read by a ``GroupQueryAttention`` with ``sliding_window_cache=1``
(Gemma 2/3's local layers from GenAI's builder, ``past_sliding_length``) holds a window, not the
context: its buffer has the rows its past input declares, or ``local_window_size`` when the axis
is symbolic (the one capacity ONNX Runtime's CUDA provider accepts), whatever the other layers'
capacity (``window_capacity``, ``capacity_of``); the op evicts inside it, so it bounds no position.

Decoding is batch 1: a model whose batch axis is fixed to another size is refused.

Declared shapes are checked when the roles are read: a dimension declared negative on any role's
input or output, a kv-heads or head-size axis that is not a fixed positive size, or a fixed
sequence axis of 0 is ``NotADecoder`` naming the input and the axis. A fixed KV cache is
allocated only within the host budget (``lockstep.host_memory.host_budget``, every layer's key and
value together): a capacity of 2**36 is ``KVCacheTooLarge`` (a ``NotADecoder``), not 8 TiB asked of numpy.

Position limit: a step that would pass the model's last position is refused before it runs
(``ContextLimitExceeded``, naming the limit and where it comes from): a fixed KV capacity, or the
rows of a position table the graph indexes by position -- the cos/sin caches of RotaryEmbedding
(with position_ids) or of GroupQueryAttention (``do_rotary``), or any table (initializer or
Constant) that a Gather reads by the ``position_ids`` input. The smallest such limit applies.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import onnx

from lockstep.errors import LockstepError, type_name

__all__ = ["DecoderIO", "NotADecoder", "KVCacheTooLarge", "ModelCardError", "StepError", "ContextLimitExceeded",
           "read_card", "parse_io_option", "card_path_for", "position_limit", "ROLES"]

ROLES = ("input_ids", "attention_mask", "position_ids", "logits", "past", "present", "kv_layout", "head_size",
         "kv_capacity")
_SIZES = ("head_size", "kv_capacity")  # roles that are sizes, not names
_EXTRAS = {"num_logits_to_keep": "zero (all logits)", "logits_to_keep": "zero (all logits)",
           "cache_position": "the positions of the step's tokens"}
_PAST_DEFAULT = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_PRESENT_DEFAULT = (re.compile(r"^present\.(\d+)\.(key|value)$"), re.compile(r"^present_key_values\.(\d+)\.(key|value)$"))
_CARD_EXAMPLE = ('[io]\ninput_ids = "..."\nattention_mask = "..."  # or ""\nposition_ids = "..."  # or ""\n'
                 'logits = "..."\npast = "...{layer}...{kind}"\npresent = "...{layer}...{kind}"\nkv_layout = "BNSH"')


class NotADecoder(LockstepError, ValueError):
    """The model's inputs and outputs are not those of a decoder lockstep can drive (or are
    ambiguous); the message lists what was found and how to say it with a model card."""


class KVCacheTooLarge(NotADecoder):
    """The KV cache the model declares (fixed capacity x heads x head size, every layer) does not fit
    the host's budget for it (``lockstep.host_memory.host_budget``); raised before anything is
    allocated, naming the inputs, the declared shape, the bytes and the budget."""


class StepError(LockstepError, ValueError):
    """A decode step the model cannot take: no tokens, or (``ContextLimitExceeded``) past its limit."""


class ModelCardError(LockstepError, ValueError):
    """A model card (TOML or ``--io``) is malformed or names what the model does not have."""


class ContextLimitExceeded(StepError):
    """A decode would pass the model's last position (its KV capacity or its position tables);
    raised before the step runs, naming the limit and where it comes from."""


def _window_pasts(g: onnx.GraphProto, pasts: set[str], past_of: dict[str, str]) -> dict[str, int]:
    """Past inputs read as a window-sized cache -- past_key/past_value (inputs 3, 4) or present outputs
    (1, 2) of a ``GroupQueryAttention`` with ``sliding_window_cache=1`` -- each with its
    ``local_window_size``. A past read by two such nodes with different windows is ``NotADecoder``."""
    out: dict[str, int] = {}
    for n in g.node:
        if n.op_type != "GroupQueryAttention" or not any(a.name == "sliding_window_cache" and a.i for a in n.attribute):
            continue
        window = next((int(a.i) for a in n.attribute if a.name == "local_window_size"), -1)
        names = [x for x in n.input[3:5] if x in pasts] + [past_of[x] for x in n.output[1:3] if x in past_of]
        for name in names:
            if window < 1:
                raise NotADecoder(f"GroupQueryAttention node {n.name!r}: sliding_window_cache=1 needs a positive "
                                  f"local_window_size, got {window}")
            if out.setdefault(name, window) != window:
                raise NotADecoder(f"{name} is read as a window-sized cache of {out[name]} and of {window} rows")
    return out


def _table_rows(g: onnx.GraphProto) -> dict[str, int]:
    """Rows (dim 0) of every initializer and Constant tensor of ``g``."""
    rows = {t.name: int(t.dims[0]) for t in g.initializer if len(t.dims) >= 1}
    for n in g.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
            for a in n.attribute:
                if a.name == "value" and len(a.t.dims) >= 1:
                    rows[n.output[0]] = int(a.t.dims[0])
    return rows


def position_limit(model: onnx.ModelProto, position_ids: str | None) -> tuple[int, str]:
    """(number of positions, what bounds it) from the model's position tables, or (0, "") if none
    is found (see the module docstring)."""
    g = model.graph
    rows = _table_rows(g)
    found: list[tuple[int, str]] = []
    for n in g.node:
        name = n.name or n.op_type
        tables: list[str] = []
        if n.op_type == "RotaryEmbedding" and len(n.input) > 3 and n.input[3]:
            tables = list(n.input[1:3])
        elif n.op_type == "GroupQueryAttention" and any(a.name == "do_rotary" and a.i for a in n.attribute):
            tables = list(n.input[7:9])
        elif (n.op_type == "Gather" and position_ids and len(n.input) > 1 and n.input[1] == position_ids
              and all(a.i == 0 for a in n.attribute if a.name == "axis")):
            tables = [n.input[0]]
        for t in tables:
            if t in rows:
                found.append((rows[t], f"the {rows[t]} rows of {t!r} read by {n.op_type} node {name!r}"))
    return min(found, default=(0, ""))


def card_path_for(model_path: str | Path) -> Path:
    """Where a model's card lives: ``model.onnx`` -> ``model.lockstep.toml``."""
    p = Path(model_path)
    return p.with_name(p.stem + ".lockstep.toml")


def read_card(path: str | Path) -> dict[str, str]:
    """The ``[io]`` table of a model card, checked for known roles."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ModelCardError(f"model card {path}: {exc}") from None
    io = data.get("io")
    if not isinstance(io, dict) or not io:
        raise ModelCardError(f"model card {path}: no [io] table mapping roles to names; e.g.\n{_CARD_EXAMPLE}")
    return _check_roles(io, f"model card {path}")


def parse_io_option(text: str) -> dict[str, str]:
    """``--io input_ids=tokens,past=cache.{layer}.{kind}`` -> a card's ``[io]`` mapping."""
    out = {}
    for part in [p for p in text.split(",") if p.strip()]:
        role, eq, name = part.partition("=")
        if not eq:
            raise ModelCardError(f"--io: {part!r} is not role=name (roles: {', '.join(ROLES)})")
        out[role.strip()] = name.strip()
    return _check_roles(out, "--io")


def _check_roles(io: Mapping[str, Any], where: str) -> dict[str, str]:
    unknown = sorted(set(io) - set(ROLES))
    if unknown:
        raise ModelCardError(f"{where}: unknown role(s) {unknown}; roles: {', '.join(ROLES)}")
    io = dict(io)
    for role in _SIZES:
        if role in io:
            v = io[role]
            n = v if isinstance(v, int) and not isinstance(v, bool) else int(v) if isinstance(v, str) and v.isdigit() else None
            if n is None or n < 1:
                raise ModelCardError(f"{where}: {role} must be a positive integer, got {v!r}")
            io[role] = str(n)
    bad = {k: v for k, v in io.items() if not isinstance(v, str)}
    if bad:
        raise ModelCardError(f"{where}: each role maps to a name (a string): {bad}")
    if io.get("kv_layout", "BNSH") not in ("BNSH", "BSNH"):
        raise ModelCardError(f"{where}: kv_layout must be BNSH or BSNH, got {io['kv_layout']!r}")
    for role in ("past", "present"):
        if role in io and not ("{layer}" in io[role] and "{kind}" in io[role]):
            raise ModelCardError(f"{where}: {role} must be a pattern with {{layer}} and {{kind}}, got {io[role]!r}")
    return dict(io)


def _dims(vi: onnx.ValueInfoProto) -> list[int | str | None]:
    """Each dimension: its size, its symbol, or None when unnamed."""
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return []
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]


def _describe(values, most: int = 8) -> str:
    """The first ``most`` values with their dims, and how many more (a message stays a line on a
    model of hundreds of inputs)."""
    values = list(values)
    shown = ", ".join(f"{v.name} {_dims(v)}" for v in values[:most]) or "none"
    return shown + (f" and {len(values) - most} more" if len(values) > most else "")


def _few(names, most: int = 8) -> str:
    """The first ``most`` names as a list, and how many more."""
    names = list(names)
    return f"{names[:most]}" + (f" and {len(names) - most} more" if len(names) > most else "")


def _pattern(template: str) -> re.Pattern:
    parts = re.split(r"(\{layer\}|\{kind\})", template)
    rx = "".join(r"(?P<layer>\d+)" if p == "{layer}" else r"(?P<kind>key|value)" if p == "{kind}" else re.escape(p)
                 for p in parts)
    return re.compile(f"^{rx}$")


def _match_kv(values, patterns) -> dict[tuple[int, str], Any]:
    out = {}
    for v in values:
        for rx in patterns:
            m = rx.match(v.name)
            if m:
                out[(int(m.group("layer") if "layer" in rx.groupindex else m.group(1)),
                     m.group("kind") if "kind" in rx.groupindex else m.group(2))] = v
                break
    return out


@dataclass(frozen=True)
class DecoderIO:
    """The roles of a decoder's inputs and outputs (see the module docstring)."""

    input_ids: str
    logits: str
    pasts: tuple[str, ...]          # past inputs, layer by layer, key then value
    present_of: dict[str, str]      # past name -> present name
    kv_heads: int
    head_dim: int
    kv_dtype: np.dtype
    capacity: int                   # fixed KV length, or 0 for a growing cache
    vocab: int
    logits_dtype: np.dtype
    seq_axis: int = 2               # 2: BNSH, 1: BSNH
    attention_mask: str | None = None
    position_ids: str | None = None
    extras: dict[str, str] = field(default_factory=dict)  # name -> role (num_logits_to_keep, cache_position)
    feed_dtypes: dict[str, np.dtype] = field(default_factory=dict)
    convention: str = "lockstep"
    max_positions: int = 0          # positions the model's tables cover, or 0 when none is found
    limit_source: str = ""          # what bounds max_positions (position_limit)
    window_capacity: dict[str, int] = field(default_factory=dict)  # past name -> rows of a window-sized cache

    @property
    def n_layers(self) -> int:
        return len(self.pasts) // 2

    @property
    def kv_layout(self) -> str:
        return "BNSH" if self.seq_axis == 2 else "BSNH"

    def capacity_of(self, past: str | None = None) -> int:
        """Rows of ``past``'s buffer: its window for a window-sized cache, else the capacity (0 when growing)."""
        return self.window_capacity.get(past, self.capacity) if past is not None else self.capacity

    def cache_shape(self, length: int | None = None, past: str | None = None) -> list[int]:
        """One past input's shape holding ``length`` positions (default: ``past``'s rows,
        ``capacity_of``; the capacity, 0 when growing, when no past is named)."""
        n = self.capacity_of(past) if length is None else length
        return [1, self.kv_heads, n, self.head_dim] if self.seq_axis == 2 else [1, n, self.kv_heads, self.head_dim]

    def cache_bytes(self, length: int | None = None) -> int:
        """Bytes of every layer's key and value cache, each holding ``length`` positions or, by default,
        its own rows (at least one: a growing cache's first position) (Python ints: a declared shape
        may pass int64)."""
        rows = [length if length is not None else self.capacity_of(p) or 1 for p in self.pasts]
        return sum(math.prod(self.cache_shape(n)) for n in rows) * np.dtype(self.kv_dtype).itemsize

    def empty_cache(self, past: str | None = None, budget: int | None = None) -> np.ndarray:
        """``past``'s initial value (zeros of its rows, ``capacity_of``, or no positions when growing;
        without ``past``, a buffer of the capacity), after checking that every layer's cache fits
        ``budget`` bytes (default: the host budget, ``lockstep.host_memory.host_budget``):
        ``KVCacheTooLarge`` otherwise, before allocating. Name the past: a window-sized layer's
        buffer is not the others' size."""
        if past is not None and past not in self.present_of:
            raise KeyError(f"{past!r} is not a past input of this decoder ({', '.join(self.pasts)})")
        # a growing cache starts empty, but one position of it must fit too (2**62 declared heads do not)
        shape = self.cache_shape(self.capacity or 1)
        need = self.cache_bytes()
        from lockstep.host_memory import fmt_bytes, host_budget

        limit = host_budget() if budget is None else None
        cap, why = (limit.nbytes, limit.why) if limit is not None else (budget, "the budget given")
        if need > cap:
            held = (f"a fixed capacity of {self.capacity} positions is declared on axis {self.seq_axis}" if self.capacity
                    else f"one position of the growing cache (axis {self.seq_axis})")
            raise KVCacheTooLarge(
                f"the KV cache the model declares does not fit in host memory: {len(self.pasts)} past inputs "
                f"({self.pasts[0]}, ...) of shape {shape} {np.dtype(self.kv_dtype).name} take "
                f"{fmt_bytes(need)}, over the budget of {fmt_bytes(cap)} ({why}); {held}")
        return np.zeros(self.cache_shape(past=past), self.kv_dtype)

    def empty_caches(self, budget: int | None = None) -> dict[str, np.ndarray]:
        """Every past input's initial value (``empty_cache``), each its own array, the budget checked once."""
        first = self.empty_cache(self.pasts[0], budget)
        return {p: first if i == 0 else np.zeros(self.cache_shape(past=p), self.kv_dtype)
                for i, p in enumerate(self.pasts)}

    def others(self, outputs: Mapping[str, Any]) -> dict[str, Any]:
        """The ``outputs`` (by name) other than the logits and the presents: what a decode session's
        optional ``values()`` returns (``lockstep locate --session``'s exposed values)."""
        presents = set(self.present_of.values())
        return {k: v for k, v in outputs.items() if k != self.logits and k not in presents}

    def has_room(self, n: int) -> bool:
        """Whether a context of ``n`` positions fits the model (its KV capacity, its position tables)."""
        return not ((self.capacity and n > self.capacity) or (self.max_positions and n > self.max_positions))

    def check_room(self, position: int, n: int) -> None:
        """Refuse a step of ``n`` tokens at ``position`` that the model cannot hold (before it runs)."""
        if n < 1:
            raise StepError(f"a decode step needs at least one token, got {n}")
        if self.capacity and position + n > self.capacity:
            raise ContextLimitExceeded(f"KV capacity {self.capacity} exceeded: position {position} + {n} tokens")
        if self.max_positions and position + n > self.max_positions:
            raise ContextLimitExceeded(
                f"position limit {self.max_positions} exceeded: position {position} + {n} tokens would use "
                f"position {position + n - 1}, past {self.limit_source}")

    def step_feeds(self, ids, position: int, *, fixed_shapes: bool = False) -> dict[str, np.ndarray]:
        """The non-cache feeds of a step appending ``ids`` at ``position`` (batch 1): ids, the
        attention mask, positions, extras. The mask marks the filled positions (every key so far,
        ``filled = position + n``; no padding), in the form the model's convention documents:

        - a growing cache: ``filled`` columns of ones;
        - ONNX Runtime GenAI's (``convention == "genai"``: GroupQueryAttention reads
          ``seqlens_k = ReduceSum(mask) - 1`` and ``total_sequence_length = mask width``): ``filled``
          columns of ones, also over a shared (fixed-capacity) buffer, because GroupQueryAttention's
          documented contract is ``total_sequence_length`` = past + new = ``max(seqlens_k) + 1``
          (ONNX Runtime's contrib-op schema; nxrt's CPU kernel refuses anything else). With
          ``fixed_shapes=True`` (a session whose every step must have one shape: a captured graph,
          fixed bindings) it is ``capacity`` columns, ones over the filled positions and zeros beyond:
          the form ONNX Runtime GenAI feeds its CUDA graphs, whose kernels (ONNX Runtime's, nxrt's
          CUDA) read ``total_sequence_length`` as a capacity;
        - any other mask over a fixed-capacity buffer (one column per key slot, as Optimum's exports
          and lockstep's shared-buffer forms read it): ``capacity`` columns, ones over the filled
          positions, zeros beyond (ones over the whole buffer would let the query attend empty slots).
        """
        ids = np.asarray([list(ids)], self.feed_dtypes.get(self.input_ids, np.int64))
        n = ids.shape[1]
        positions = np.arange(position, position + n)
        feeds = {self.input_ids: ids}
        if self.attention_mask:
            filled = position + n
            trimmed = self.convention == "genai" and not fixed_shapes
            mask = np.zeros((1, filled if trimmed else (self.capacity or filled)), self.feed_dtypes[self.attention_mask])
            mask[:, :filled] = 1
            feeds[self.attention_mask] = mask
        if self.position_ids:
            feeds[self.position_ids] = positions[None, :].astype(self.feed_dtypes[self.position_ids])
        for name, role in self.extras.items():
            dt = self.feed_dtypes[name]
            feeds[name] = positions.astype(dt) if role == "cache_position" else np.array(0, dt)
        return feeds

    def fixed_model(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """``model`` with the shapes this fixed-capacity decode feeds written into its declared I/O:
        a past/present sequence axis, head size or mask length that the graph leaves symbolic (GenAI's
        builder: ``past_sequence_length``, ``kv_cache_dim``, ``total_sequence_length``, bound by
        genai_config.json's shared buffer) becomes the capacity and head size. A runtime then sees
        nothing that grows from step to step, as for a model that declares its capacity. The model
        itself when there is nothing to bind (a growing cache, or dims already fixed)."""
        if not self.capacity:
            return model
        from lockstep.shared_buffer import shared_buffer

        model = shared_buffer(model, self)  # a growing cache given a capacity: written as a shared buffer
        rows = {n: self.capacity_of(p) for p in self.pasts for n in (p, self.present_of[p])}
        todo = []
        for vi in [*model.graph.input, *model.graph.output]:
            dims = vi.type.tensor_type.shape.dim
            if vi.name in rows and len(dims) == 4:
                want = {self.seq_axis: rows[vi.name], 3: self.head_dim}
            elif vi.name == self.attention_mask and len(dims) == 2:
                want = {1: self.capacity}
            else:
                continue
            if any(not dims[a].HasField("dim_value") for a in want):
                todo.append((vi.name, want))
        if not todo:
            return model
        out = onnx.ModelProto()
        out.CopyFrom(model)
        by_name = {vi.name: vi for vi in [*out.graph.input, *out.graph.output]}
        for name, want in todo:
            dims = by_name[name].type.tensor_type.shape.dim
            for a, n in want.items():
                dims[a].Clear()
                dims[a].dim_value = n
        return out

    # -- detection ------------------------------------------------------------------------------
    @classmethod
    def of(cls, model: onnx.ModelProto, card: Mapping[str, str] | None = None) -> "DecoderIO":
        """The roles of ``model``'s inputs and outputs, from the graph (and ``card`` where given)."""
        from lockstep.loading import np_dtype

        card = dict(card or {})
        g = model.graph
        init = {t.name for t in g.initializer}
        inputs = [vi for vi in g.input if vi.name not in init]
        outputs = list(g.output)
        by_in = {vi.name: vi for vi in inputs}
        by_out = {vo.name: vo for vo in outputs}
        found = f"inputs: {_describe(inputs)}; outputs: {_describe(outputs)}"

        def fail(why: str) -> NotADecoder:
            return NotADecoder(f"not a decoder lockstep can drive: {why}. Found {found}. If it is one, say which "
                               f"name plays which role in a model card: <model>.lockstep.toml with an [io] table "
                               f"({', '.join(ROLES)}; past/present as patterns with {{layer}} and {{kind}}), "
                               f"or --io role=name,...")

        def named(role: str, default: str | None, pool: dict, required: bool) -> str | None:
            if role in card:
                name = card[role]
                if name == "":
                    if required:
                        raise ModelCardError(f"model card: {role} is required, it cannot be \"\"")
                    return None
                if name not in pool:
                    raise ModelCardError(f"model card: {role} = {name!r} is not a graph "
                                         f"{'input' if pool is by_in else 'output'} {_few(pool)}")
                return name
            if default in pool:
                return default
            if required:
                raise fail(f"no {role} {'input' if pool is by_in else 'output'}")
            return None

        input_ids = named("input_ids", "input_ids", by_in, True)
        logits = named("logits", "logits", by_out, True)
        mask = named("attention_mask", "attention_mask", by_in, False)
        positions = named("position_ids", "position_ids", by_in, False)

        past_rx = [_pattern(card["past"])] if "past" in card else [_PAST_DEFAULT]
        present_rx = [_pattern(card["present"])] if "present" in card else list(_PRESENT_DEFAULT)
        pasts = _match_kv(inputs, past_rx)
        presents = _match_kv(outputs, present_rx)
        if not pasts:
            raise fail("no past key/value inputs (a decoder without a KV cache is not decoded by lockstep)")
        layers = sorted({layer for layer, _ in pasts})
        if layers != list(range(len(layers))) or any((layer, k) not in pasts for layer in layers for k in ("key", "value")):
            raise fail(f"past inputs must be key and value for layers 0..n-1, found {_few(sorted(pasts))}")
        missing = [k for k in pasts if k not in presents]
        if missing:
            raise fail(f"no present output for past {[pasts[k].name for k in missing]}")

        used = {input_ids, mask, positions, *(v.name for v in pasts.values())}
        extras, unknown = {}, []
        for vi in inputs:
            if vi.name in used:
                continue
            if vi.name in _EXTRAS:
                extras[vi.name] = "cache_position" if vi.name == "cache_position" else "logits_to_keep"
            else:
                unknown.append(vi.name)
        if unknown:
            raise fail(f"inputs lockstep does not know how to feed: {_few(unknown)} (it feeds input_ids, attention_mask, "
                       f"position_ids, {', '.join(_EXTRAS)} and the past key/values)")

        ordered = [pasts[(layer, k)] for layer in layers for k in ("key", "value")]
        for key in [(layer, k) for layer in layers for k in ("key", "value")]:
            pt, qt = pasts[key].type.tensor_type.elem_type, presents[key].type.tensor_type.elem_type
            if pt != qt:  # Optimum's fp16 Gemma 2/3 exports: present.1.* float32 beside float16 pasts
                raise NotADecoder(f"not a decoder lockstep can drive: {presents[key].name} is {type_name(qt)} "
                           f"but {pasts[key].name} is {type_name(pt)}: a "
                           f"present is fed back as the next step's past, so their types must agree (an exporter bug)")
        roles = [by_in[n] for n in (input_ids, mask, positions) if n] + ordered + [by_in[n] for n in extras]
        for vi in [*roles, by_out[logits], *presents.values()]:
            d = _dims(vi)
            bad = [(axis, v) for axis, v in enumerate(d) if isinstance(v, int) and v < 0]
            if bad:
                axis, v = bad[0]
                raise fail(f"{vi.name} {d}: axis {axis} is declared {v} (a dimension is a size >= 0 or a symbol)")
        windows = _window_pasts(g, {v.name for v in ordered}, {presents[k].name: pasts[k].name for k in pasts})
        layouts = {vi.name: cls._layout(vi, card, fail, windows.get(vi.name, 0)) for vi in ordered}
        full = [vi for vi in ordered if vi.name not in windows] or ordered[:1]
        seq_axis, capacity, heads, head_dim = layouts[full[0].name]
        for vi in ordered:
            got = layouts[vi.name]
            if got[0] != seq_axis or got[2:] != (heads, head_dim) or (vi.name not in windows and got[1] != capacity):
                raise fail(f"past inputs disagree on their layout ({full[0].name} vs {vi.name})")
        window_capacity = {n: layouts[n][1] for n in windows}
        if full[0].name in windows:  # every layer windowed: the context's capacity is the card's, if any
            capacity = int(card["kv_capacity"]) if "kv_capacity" in card else 0
        for vi in inputs:
            if vi.name in (input_ids, mask, positions):
                d = _dims(vi)
                if len(d) != 2:
                    raise fail(f"{vi.name} must be [batch, sequence], got {d}")
                if vi.name == mask and isinstance(d[1], int) and d[1] != capacity:
                    raise fail(f"{vi.name} {d}: a mask of fixed length {d[1]} needs a KV cache of that capacity "
                               f"(the past inputs hold {capacity or 'a growing number of'} positions)")
                if isinstance(d[0], int) and d[0] not in (0, 1):
                    raise NotADecoder(f"{vi.name}: batch axis fixed to {d[0]}; lockstep decodes batch 1 "
                                      "(re-export with a symbolic or unit batch axis)")
        ldims = _dims(by_out[logits])
        if len(ldims) != 3 or not isinstance(ldims[-1], int) or not ldims[-1]:
            raise fail(f"{logits} must be [batch, sequence, vocab] with a fixed vocab, got {ldims}")
        feed_dtypes = {vi.name: np_dtype(vi.type.tensor_type.elem_type, vi.name) for vi in inputs if vi.name not in
                       {v.name for v in ordered}}
        convention = ("lockstep" if not mask else "optimum" if positions else "genai"
                      if any(n.op_type == "GroupQueryAttention" for n in g.node) else "optimum")
        max_positions, limit_source = position_limit(model, positions)
        return cls(input_ids=input_ids, logits=logits, pasts=tuple(v.name for v in ordered),
                   present_of={pasts[k].name: presents[k].name for k in pasts}, kv_heads=heads, head_dim=head_dim,
                   kv_dtype=np_dtype(ordered[0].type.tensor_type.elem_type, ordered[0].name), capacity=capacity,
                   vocab=ldims[-1],
                   logits_dtype=np_dtype(by_out[logits].type.tensor_type.elem_type, logits), seq_axis=seq_axis,
                   attention_mask=mask, position_ids=positions, extras=extras, feed_dtypes=feed_dtypes,
                   convention=convention, max_positions=max_positions, limit_source=limit_source,
                   window_capacity=window_capacity)

    @staticmethod
    def _layout(vi: onnx.ValueInfoProto, card: Mapping[str, str], fail, window: int = 0) -> tuple[int, int, int, int]:
        """(sequence axis, capacity or 0, kv heads, head size) of a past input; ``window``: the
        past is a window-sized cache of that window (its capacity: the declared rows, else the window)."""
        d = _dims(vi)
        if len(d) != 4:
            raise fail(f"{vi.name} must be rank 4 [batch, kv heads, sequence, head size] (or BSNH), got {d}")
        if "head_size" in card:
            want = int(card["head_size"])
            if isinstance(d[3], int) and d[3] != want:
                raise ModelCardError(f"model card: head_size {want}, but {vi.name} {d} declares {d[3]}")
            d[3] = want
        if not isinstance(d[3], int) or not d[3]:
            raise fail(f"{vi.name}: the head size (last axis) must be a fixed positive size, got {d} (a model card's "
                       f"head_size says it: genai_config.json's model.decoder.head_size is read when it is beside the "
                       f"model)")
        symbolic = [a for a in (1, 2) if not isinstance(d[a], int)]
        if "kv_layout" in card:
            axis = 2 if card["kv_layout"] == "BNSH" else 1
            if len(symbolic) == 1 and symbolic[0] != axis:
                raise ModelCardError(f"model card: kv_layout {card['kv_layout']} puts the sequence on axis {axis} "
                                     f"but {vi.name} {d} grows on axis {symbolic[0]}")
        elif len(symbolic) == 1:
            axis = symbolic[0]
        elif not symbolic:
            axis = 2  # a fixed-capacity cache: the attention ops' layout (BNSH)
        else:
            raise fail(f"{vi.name} {d}: both middle axes are symbolic; which is the sequence? (kv_layout)")
        heads = d[3 - axis]
        if not isinstance(heads, int) or not heads:
            raise fail(f"{vi.name}: the kv-heads axis must be a fixed positive size, got {d}")
        if isinstance(d[0], int) and d[0] != 1:
            raise NotADecoder(f"{vi.name}: batch axis fixed to {d[0]}; lockstep decodes batch 1 "
                              "(re-export with a symbolic or unit batch axis)")
        capacity = d[axis] if isinstance(d[axis], int) else 0
        if window:  # a window-sized cache: the context's capacity (kv_capacity) is not its size
            if capacity and capacity < window:
                raise fail(f"{vi.name} {d}: a window-sized cache (sliding_window_cache=1) of {capacity} rows "
                           f"holds less than its window ({window})")
            return axis, capacity or window, heads, d[3]
        if "kv_capacity" in card:  # a shared past/present buffer of this many positions
            want = int(card["kv_capacity"])
            if capacity and capacity != want:
                raise ModelCardError(f"model card: kv_capacity {want}, but {vi.name} {d} declares {capacity} on "
                                     f"axis {axis}")
            capacity = want
        if isinstance(d[axis], int) and not capacity:
            raise fail(f"{vi.name} {d}: the sequence axis ({axis}) is fixed to 0: a cache of no positions "
                       "holds nothing (a growing cache has a symbolic sequence axis, a fixed one its capacity)")
        return axis, capacity, heads, d[3]

"""Generative models on a loaded :class:`Servable`: detect the signature convention, drive it.

Two conventions make a version servable for token generation:

* **LiteRT LLM** (ai-edge-torch's generative converter): signatures ``prefill`` or
  ``prefill_<N>`` (inputs ``tokens`` [1, N], ``input_pos`` [N], the external KV cache
  ``kv_cache_k_<i>`` / ``kv_cache_v_<i>``, optionally ``mask`` [1, 1, N, L]) and ``decode``
  (``tokens`` [B, 1], ``input_pos`` [B] per sequence or [1] shared, the cache with batch B,
  optionally ``mask`` [B, 1, 1, L]); outputs ``logits`` (decode) and the updated cache under
  the input names. Prefill logits are not needed: the prompt minus its last token is
  prefilled, and the last token is the stream's first decode input.
* **generate_step** (hand-written SavedModels): inputs ``input_ids`` [batch, n], and
  optionally ``cache`` [batch, ...] with ``input_pos`` [batch] (position of each row's first
  id); outputs ``logits`` ([batch, vocab] or [batch, n, vocab]: the last is used) and, with
  a cache, ``cache``. Without a cache the whole history is fed each step.

A driver holds no stream state: the caller owns :class:`Slots`, the server-side KV cache of
up to ``capacity`` sequences, one row each, kept between steps (and ``calls``: the rows of
each model call the last ``decode`` made, what the ``step_rows`` metric counts).

**Aligned rows.** litert-torch writes one ``input_pos`` [1] for a decode batch B > 1: every
row of a call is at the same position. Where the decode signature also takes the ``mask``
(``ExportConfig.mask_as_input``), rows need not *be* at the same position: a row's sequence
may sit at an offset (its prompt prefilled from ``start``), the mask hiding every key
before it. Rotary position embeddings depend on the distance between query and key only,
so the shifted sequence computes the same attention (up to float rounding) while sharing
the call; ``LiteRTLLM.aligned`` says a driver can do this, and ``decode``'s ``starts`` give
each row's first key. Without the mask input the model's own causal mask shows every key
from 0: rows at different positions need a call each. A decode signature with a
fixed batch B runs all B rows every call (streams are packed into the rows, empty rows
compute and are ignored); a dynamic batch runs rows ``0..n-1`` (the caller keeps active
rows packed at the front with ``move``). Drivers are not thread-safe: one decode loop
drives one ``Slots``. This module imports numpy only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from .base import LoadFailure, Servable, SignatureInfo

KV_PREFIX = "kv_cache_"
PREFILL_RE = re.compile(r"prefill(?:_(\d+))?")
MASKED = float(np.finfo(np.float32).min)  # additive mask value for positions a query must not see

Shapes = Mapping[str, Mapping[str, tuple[int, ...] | None]]


@dataclass
class Slots:
    """The cache of up to ``capacity`` sequences: ``arrays`` (name -> [capacity, ...]) for
    models with a cache, ``history`` (token ids per row) for a generate_step without one."""

    capacity: int
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    history: list[list[int]] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)  # rows of each model call of the last decode


class Driver:
    """Common part of both conventions (see module docstring)."""

    kind = ""
    batch_size: int | None = None  # fixed decode batch; None: any number of rows
    context_length: int | None = None  # positions the cache holds; None: unknown
    vocab_size = 0

    def __init__(self, servable: Servable):
        self.servable = servable

    def new_slots(self, capacity: int) -> Slots:
        raise NotImplementedError

    aligned = False  # rows at different positions may share a call (module docstring)

    def prefill(self, slots: Slots, row: int, prompt: Sequence[int], start: int = 0) -> None:
        """Make ``row`` hold ``prompt[:-1]`` from position ``start`` (0 unless ``aligned``);
        ``prompt[-1]`` is the row's first decode token, at ``start + len(prompt) - 1``."""
        raise NotImplementedError

    def decode(self, slots: Slots, rows: Sequence[int], tokens: Sequence[int], positions: Sequence[int],
               starts: Sequence[int] | None = None) -> np.ndarray:
        """One step of the given rows: next-token logits [len(rows), vocab]. ``starts``: each
        row's first position (``aligned`` drivers; else all 0). Sets ``slots.calls``."""
        raise NotImplementedError

    def copy_row(self, src: Slots, src_row: int, dst: Slots, dst_row: int) -> None:
        """Copy one sequence's cache into another row (of the same or another ``Slots``):
        n choices of one prompt share its prefill."""
        for name, array in src.arrays.items():
            dst.arrays[name][dst_row] = array[src_row]
        if src.history:
            dst.history[dst_row] = list(src.history[src_row])

    def move(self, slots: Slots, src: int, dst: int) -> None:
        """Copy one sequence's cache to another row (keeps a dynamic batch packed)."""
        for array in slots.arrays.values():
            array[dst] = array[src]
        if slots.history:
            slots.history[dst] = slots.history[src]

    def warm_up(self) -> None:
        """One short prompt and one step: allocates what the first request would."""
        slots = self.new_slots(self.batch_size or 1)
        self.prefill(slots, 0, [0, 0])
        self.decode(slots, [0], [0], [1])

    def _rows(self, n: int) -> int:
        """Rows one call feeds: the fixed batch, else exactly ``n``."""
        return self.batch_size or n

    def _run(self, signature: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.servable.run(signature, feeds)

    def describe(self) -> dict[str, Any]:
        return {"convention": self.kind, "decode_batch": self.batch_size or "dynamic",
                "context_length": self.context_length, "vocab_size": self.vocab_size, **self._details()}

    def _details(self) -> dict[str, Any]:
        return {}


def _batch(shape: tuple[int, ...] | None) -> int | None:
    return shape[0] if shape and shape[0] > 0 else None


def _own(array: np.ndarray) -> np.ndarray:
    """A backend's output kept as the next step's cache: used as is when writable."""
    return array if array.flags.writeable else array.copy()


def _last_logits(logits: np.ndarray, rows: int) -> np.ndarray:
    return logits.reshape(rows, -1, logits.shape[-1])[:, -1]


class LiteRTLLM(Driver):
    """The prefill/decode convention of ai-edge-torch's generative converter."""

    kind = "litert-llm"

    def __init__(self, servable: Servable, declared: Shapes):
        super().__init__(servable)
        sigs = servable.signatures
        # (prefill length, signature); length 0: the signature takes any length.
        self.prefills = sorted((_dim(declared[name]["tokens"], 1) or 0, name)
                               for name in sigs if PREFILL_RE.fullmatch(name))
        if self.prefills[0][0] == 0:
            self.prefills = self.prefills[:1]
        dec, shapes = sigs["decode"], declared["decode"]
        self.kv_names = sorted(n for n in dec.inputs if n.startswith(KV_PREFIX))
        missing = [n for n in ("tokens", "input_pos") if n not in dec.inputs] + \
                  ["logits"] * ("logits" not in dec.outputs) + ["kv_cache_* inputs"] * (not self.kv_names)
        if missing:
            raise LoadFailure(f"the decode signature does not follow the LiteRT LLM convention: it lacks "
                              f"{', '.join(missing)}")
        self.batch_size = _batch(shapes["tokens"])
        self.pos_rows = _batch(shapes["input_pos"])
        self.shared_position = bool(self.batch_size and self.batch_size > 1 and self.pos_rows == 1)
        self.has_mask = "mask" in dec.inputs
        self.aligned = self.shared_position and self.has_mask
        mask_length = _dim(shapes["mask"], 3) if self.has_mask else None  # [B, 1, 1, L]
        self.kv_layout, self.context_length = cache_layout(shapes, self.kv_names, mask_length)
        self.vocab_size = int((dec.outputs["logits"].shape or (0,))[-1])
        self.row_shapes = {n: tuple(shapes[n] or ())[1:] for n in self.kv_names}
        self.dtypes = {n: dec.inputs[n].dtype for n in self.kv_names}

    def _details(self) -> dict[str, Any]:
        return {"prefill_windows": [n or "dynamic" for n, _ in self.prefills], "kv_layout": self.kv_layout,
                "mask_input": self.has_mask, "shared_position": self.shared_position, "aligned_rows": self.aligned}

    def new_slots(self, capacity: int) -> Slots:
        rows = self.batch_size or capacity
        return Slots(rows, {n: np.zeros((rows, *self.row_shapes[n]), self.dtypes[n]) for n in self.kv_names})

    def _mask(self, rows: int, queries: np.ndarray, starts: np.ndarray | None = None) -> np.ndarray:
        """[rows, 1, q, L]: 0 where ``start <= key position <= the query's``, else MASKED."""
        keys = np.arange(self.context_length or 0)[None, None, None, :]
        allowed = keys <= queries.reshape(rows, 1, -1, 1)
        if starts is not None:
            allowed &= keys >= np.asarray(starts).reshape(rows, 1, 1, 1)
        return np.where(allowed, 0.0, MASKED).astype(np.float32)

    def window(self, start: int, remaining: int) -> tuple[str, int, int] | None:
        """(signature, window length, tokens it takes) of the prefill call at ``start``: chunks
        of the longest window, the last one in the smallest window that holds it. A window is
        used only where it fits inside the cache (start + N <= L): LiteRT writes the window's
        cache slice with DYNAMIC_UPDATE_SLICE, which clamps a slice that would run past the
        end backwards, over earlier context. None: no window fits, decode the rest."""
        first_length, first_name = self.prefills[0]
        if first_length == 0:  # a dynamic prefill length takes the chunk as it is
            return first_name, remaining, remaining
        limit = self.context_length or 0
        fits = [(n, name) for n, name in self.prefills if start + n <= limit]
        if not fits:
            return None
        take = min(remaining, fits[-1][0])
        length, name = next((n, name) for n, name in fits if n >= take)
        return name, length, take

    def prefill(self, slots: Slots, row: int, prompt: Sequence[int], start: int = 0) -> None:
        tokens = list(prompt[:-1])
        first, done = np.array([start]), 0
        while done < len(tokens):
            at = start + done
            step = self.window(at, len(tokens) - done)
            if step is None:  # near the cache end: the rest of the prompt one token per call
                for i in range(done, len(tokens)):
                    self._decode_alone(slots, row, tokens[i], start + i, start)
                return
            name, length, take = step
            chunk = tokens[done:done + take]
            # Padding goes to later positions, inside the cache (the window fits): later steps
            # overwrite them before any query may see them.
            feeds = {"tokens": np.array([chunk + [0] * (length - take)], np.int32),
                     "input_pos": np.arange(at, at + length, dtype=np.int32),
                     **{n: slots.arrays[n][row:row + 1] for n in self.kv_names}}
            if self.has_mask:
                feeds["mask"] = self._mask(1, np.arange(at, at + length), first)
            out = self._run(name, feeds)
            for n in self.kv_names:
                slots.arrays[n][row] = out[n][0]
            done += take

    def _decode_alone(self, slots: Slots, row: int, token: int, pos: int, start: int = 0) -> None:
        """One prompt token of one row through ``decode``, in a scratch batch: the other rows
        of ``slots`` (other streams, at other positions) must not take this call's writes."""
        n = self._rows(1)
        scratch = {k: np.zeros((n, *self.row_shapes[k]), self.dtypes[k]) for k in self.kv_names}
        for k in self.kv_names:
            scratch[k][0] = slots.arrays[k][row]
        tokens = np.zeros((n, 1), np.int32)
        tokens[0, 0] = token
        positions = np.full(n, pos, np.int32)
        feeds = {"tokens": tokens, "input_pos": positions[:self.pos_rows or n], **scratch}
        if self.has_mask:
            feeds["mask"] = self._mask(n, positions, np.full(n, start))
        out = self._run("decode", feeds)
        for k in self.kv_names:
            slots.arrays[k][row] = out[k][0]

    def decode(self, slots: Slots, rows: Sequence[int], tokens: Sequence[int], positions: Sequence[int],
               starts: Sequence[int] | None = None) -> np.ndarray:
        logits = np.empty((len(rows), self.vocab_size), np.float32)
        groups = {p: [i for i, q in enumerate(positions) if q == p] for p in positions} if self.shared_position \
            else {None: list(range(len(rows)))}
        slots.calls = []
        for position, members in groups.items():
            logits[members] = self._decode_group(slots, [rows[i] for i in members], [tokens[i] for i in members],
                                                 [positions[i] for i in members],
                                                 [starts[i] for i in members] if starts else None,
                                                 partial=position is not None and len(members) < len(rows))
            slots.calls.append(len(members))
        return logits

    def _decode_group(self, slots: Slots, rows: list[int], tokens: list[int], positions: list[int],
                      starts: list[int] | None, partial: bool) -> np.ndarray:
        n = self._rows(len(rows))
        if self.batch_size is None and rows != list(range(len(rows))):
            raise ValueError(f"a dynamic decode batch runs rows 0..{len(rows) - 1}, got {rows}")
        feed_tokens = np.zeros((n, 1), np.int32)
        feed_pos = np.zeros(n, np.int32)
        feed_tokens[rows, 0] = tokens
        feed_pos[rows] = positions
        shared = np.array(positions[:1], np.int32)  # every row of this call is at this position
        feeds = {"tokens": feed_tokens, "input_pos": shared if self.shared_position else feed_pos,
                 **{k: slots.arrays[k][:n] for k in self.kv_names}}
        if self.has_mask:
            feed_start = np.zeros(n, np.int32)
            if starts:
                feed_start[rows] = starts
            if self.shared_position:  # every row's query is at the shared position
                feed_pos[:] = positions[0]
            feeds["mask"] = self._mask(n, feed_pos, feed_start)
        out = self._run("decode", feeds)
        for k in self.kv_names:
            if partial:  # a shared position: other rows' caches must not take this call's writes
                slots.arrays[k][rows] = out[k][rows]
            elif n == slots.capacity:
                slots.arrays[k] = _own(out[k])
            else:
                slots.arrays[k][:n] = out[k]
        return _last_logits(out["logits"], n)[rows]


def _dim(shape: tuple[int, ...] | None, i: int) -> int | None:
    return shape[i] if shape and len(shape) > i and shape[i] > 0 else None


# litert-torch's two KV cache layouts (litert_torch.generative.layers.kv_cache): the
# default BTNH for K and V, and KV_LAYOUT_TRANSPOSED: K BNTH, V BNHT. The context length L
# sits at a different place in each.
DEFAULT_LAYOUT, TRANSPOSED_LAYOUT = "BTNH/BTNH", "BNTH/BNHT"


def cache_layout(shapes: Mapping[str, tuple[int, ...] | None], kv_names: Sequence[str],
                 mask_length: int | None) -> tuple[str, int]:
    """(layout, context length) from the declared shapes of every K and V pair (and the
    mask's L when there is one). Refuses (``LoadFailure``) what no layout fits, and shapes
    that two layouts fit with different lengths: served with the wrong one, a model would
    load and then refuse or garble every prompt."""
    found: set[tuple[str, int]] = set()
    for k in (n for n in kv_names if n.startswith(KV_PREFIX + "k_")):
        v = KV_PREFIX + "v_" + k[len(KV_PREFIX + "k_"):]
        if v not in kv_names:
            raise LoadFailure(f"the decode signature has {k} but no {v}")
        kshape, vshape = tuple(shapes[k] or ()), tuple(shapes[v] or ())
        fits = {}
        if len(kshape) == 4 and kshape == vshape:
            fits[DEFAULT_LAYOUT] = kshape[1]  # [B, L, heads, dim] both
        if len(kshape) == 4 and len(vshape) == 4 and vshape == (*kshape[:2], kshape[3], kshape[2]):
            fits[TRANSPOSED_LAYOUT] = kshape[2]  # K [B, heads, L, dim], V [B, heads, dim, L]
        if mask_length:
            fits = {layout: length for layout, length in fits.items() if length == mask_length}
        where = f"{k} {list(kshape)} and {v} {list(vshape)}" + \
            (f" with a mask of length {mask_length}" if mask_length else "")
        if not fits:
            raise LoadFailure(f"the KV cache layout cannot be decided: {where} match neither litert-torch layout "
                              f"(K and V [B, L, heads, dim], or K [B, heads, L, dim] with V [B, heads, dim, L])")
        if len(set(fits.values())) > 1:
            raise LoadFailure(f"the KV cache layout cannot be decided: {where} fit both the default layout "
                              f"(context {fits[DEFAULT_LAYOUT]}) and the transposed one (context "
                              f"{fits[TRANSPOSED_LAYOUT]}); a 'mask' input [B, 1, 1, L] would tell them apart")
        # both fitting with one length (L = heads = dim): the layout does not matter to us
        layout = next(iter(fits)) if len(fits) == 1 else f"{DEFAULT_LAYOUT} or {TRANSPOSED_LAYOUT}"
        found.add((layout, next(iter(fits.values()))))
    lengths = {length for _, length in found}
    if len(lengths) != 1 or next(iter(lengths)) <= 0:
        raise LoadFailure(f"the KV caches of the decode signature disagree on the context length: {sorted(found)}")
    return sorted(found)[0][0], lengths.pop()


class GenerateStep(Driver):
    """The ``generate_step`` signature (module docstring)."""

    kind = "generate_step"
    SIGNATURE = "generate_step"

    def __init__(self, servable: Servable, declared: Shapes):
        super().__init__(servable)
        sig = servable.signatures[self.SIGNATURE]
        shapes = declared[self.SIGNATURE]
        self.ids = "input_ids" if "input_ids" in sig.inputs else "tokens"
        if self.ids not in sig.inputs or "logits" not in sig.outputs:
            raise LoadFailure("generate_step must take 'input_ids' [batch, n] and return 'logits'")
        self.has_cache = "cache" in sig.inputs
        if self.has_cache and ("input_pos" not in sig.inputs or "cache" not in sig.outputs):
            raise LoadFailure("a generate_step with a 'cache' input must also take 'input_pos' and return 'cache'")
        self.batch_size = _batch(shapes[self.ids])
        self.id_dtype = sig.inputs[self.ids].dtype
        self.vocab_size = int((sig.outputs["logits"].shape or (0,))[-1])
        if self.has_cache:
            cache = shapes["cache"] or ()
            if len(cache) < 2 or any(d <= 0 for d in cache[1:]):
                raise LoadFailure(f"generate_step's cache must have a known shape after the batch, got {cache}")
            self.cache_shape, self.cache_dtype = tuple(cache[1:]), sig.inputs["cache"].dtype

    def new_slots(self, capacity: int) -> Slots:
        rows = self.batch_size or capacity
        if not self.has_cache:
            return Slots(rows, history=[[] for _ in range(rows)])
        return Slots(rows, {"cache": np.zeros((rows, *self.cache_shape), self.cache_dtype)})

    def prefill(self, slots: Slots, row: int, prompt: Sequence[int], start: int = 0) -> None:
        if not self.has_cache:
            slots.history[row] = list(prompt[:-1])
            return
        slots.arrays["cache"][row] = 0
        if len(prompt) < 2:
            return
        n = self._rows(1)
        ids = np.zeros((n, len(prompt) - 1), self.id_dtype)
        ids[0] = prompt[:-1]
        cache = np.zeros((n, *self.cache_shape), self.cache_dtype)
        out = self._run(self.SIGNATURE, {self.ids: ids, "input_pos": np.zeros(n, np.int32), "cache": cache})
        slots.arrays["cache"][row] = out["cache"][0]

    def decode(self, slots: Slots, rows: Sequence[int], tokens: Sequence[int], positions: Sequence[int],
               starts: Sequence[int] | None = None) -> np.ndarray:
        slots.calls = [len(rows)]
        if not self.has_cache:
            return self._decode_history(slots, rows, tokens)
        n = self._rows(len(rows))
        if self.batch_size is None and list(rows) != list(range(len(rows))):
            raise ValueError(f"a dynamic decode batch runs rows 0..{len(rows) - 1}, got {list(rows)}")
        ids = np.zeros((n, 1), self.id_dtype)
        pos = np.zeros(n, np.int32)
        ids[list(rows), 0] = tokens
        pos[list(rows)] = positions
        out = self._run(self.SIGNATURE, {self.ids: ids, "input_pos": pos, "cache": slots.arrays["cache"][:n]})
        if n == slots.capacity:
            slots.arrays["cache"] = _own(out["cache"])
        else:
            slots.arrays["cache"][:n] = out["cache"]
        return _last_logits(out["logits"], n)[list(rows)]

    def _decode_history(self, slots: Slots, rows: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """No cache: the whole history each step; rows of equal length share a call."""
        logits = np.empty((len(rows), self.vocab_size), np.float32)
        for i, (row, token) in enumerate(zip(rows, tokens)):
            slots.history[row] = slots.history[row] + [token]
        by_length: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            by_length.setdefault(len(slots.history[row]), []).append(i)
        slots.calls = []
        for length, members in by_length.items():
            for start in range(0, len(members), self.batch_size or len(members)):
                slots.calls.append(len(members[start:start + (self.batch_size or len(members))]))
                part = members[start:start + (self.batch_size or len(members))]
                ids = np.zeros((self._rows(len(part)), length), self.id_dtype)
                ids[:len(part)] = [slots.history[rows[i]] for i in part]
                out = self._run(self.SIGNATURE, {self.ids: ids})
                logits[part] = _last_logits(out["logits"], ids.shape[0])[:len(part)]
        return logits


def declared_shapes(servable: Servable) -> dict[str, dict[str, tuple[int, ...] | None]]:
    """Input shapes as the model declares them (the LiteRT backend keeps generation
    signatures' own shapes: see ``runtimes.tflite``)."""
    return {name: {n: s.shape for n, s in sig.inputs.items()} for name, sig in servable.signatures.items()}


def convention(signatures: Mapping[str, SignatureInfo]) -> str | None:
    """Which convention the signatures follow, by name alone (cheap: no model calls)."""
    if "decode" in signatures and any(PREFILL_RE.fullmatch(n) for n in signatures):
        return LiteRTLLM.kind
    if GenerateStep.SIGNATURE in signatures:
        return GenerateStep.kind
    return None


def detect(servable: Servable) -> Driver | None:
    """The driver for a servable's generation signatures; None when it has none.
    Raises ``LoadFailure`` naming what is wrong when the signatures are there but malformed."""
    kind = convention(servable.signatures)
    if kind is None:
        return None
    try:
        declared = declared_shapes(servable)
        return LiteRTLLM(servable, declared) if kind == LiteRTLLM.kind else GenerateStep(servable, declared)
    except (KeyError, IndexError, TypeError) as exc:
        raise LoadFailure(f"{kind} signatures are malformed: {type(exc).__name__}: {exc}") from exc


__all__ = ["Driver", "GenerateStep", "LiteRTLLM", "Slots", "convention", "declared_shapes", "detect"]

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

**Two decode batches.** A version may carry a batch-1 decode beside its batched one:
signatures ``decode`` and ``decode_<B>`` (any of them named ``decode``), with the same cache
inputs and both with or both without the mask. The batched one sets the lanes (``batch_size``);
each step, a group of rows at one position runs as one batched call or as one batch-1 call per
row, whichever the costs measured at load say is cheaper for that many rows
(runtimes/decode_plan.py): a lone stream no longer pays for the batch's empty rows. ``detect``
keeps one driver per servable, so what the warm-up measured is what the decode loop uses.
"""

from __future__ import annotations

import re
import weakref
from typing import Mapping, Sequence

import numpy as np

from .base import LoadFailure, Servable, SignatureInfo
from .json_types import JSONObject
from .decode_base import Driver, Shapes, Slots, batch_of, last_logits, owned
from .decode_plan import DecodePlan, measure
from .kv_layout import DEFAULT_LAYOUT, KV_PREFIX, TRANSPOSED_LAYOUT, cache_layout

PREFILL_RE = re.compile(r"prefill(?:_(\d+))?")
DECODE_RE = re.compile(r"decode(?:_(\d+))?")
MASKED = float(np.finfo(np.float32).min)  # additive mask value for positions a query must not see

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
        self.decode_sig, single = _decode_signatures(declared)
        dec, shapes = sigs[self.decode_sig], declared[self.decode_sig]
        self.kv_names = sorted(n for n in dec.inputs if n.startswith(KV_PREFIX))
        missing = [n for n in ("tokens", "input_pos") if n not in dec.inputs] + \
                  ["logits"] * ("logits" not in dec.outputs) + ["kv_cache_* inputs"] * (not self.kv_names)
        if missing:
            raise LoadFailure(f"the decode signature does not follow the LiteRT LLM convention: it lacks "
                              f"{', '.join(missing)}")
        self.batch_size = batch_of(shapes["tokens"])
        self.pos_rows = batch_of(shapes["input_pos"])
        self.shared_position = bool(self.batch_size and self.batch_size > 1 and self.pos_rows == 1)
        self.has_mask = "mask" in dec.inputs
        self.aligned = self.shared_position and self.has_mask
        mask_length = _dim(shapes["mask"], 3) if self.has_mask else None  # [B, 1, 1, L]
        self.kv_layout, self.context_length = cache_layout(shapes, self.kv_names, mask_length)
        self.vocab_size = int((dec.outputs["logits"].shape or (0,))[-1])
        self.row_shapes = {n: tuple(shapes[n] or ())[1:] for n in self.kv_names}
        self.dtypes = {n: dec.inputs[n].dtype for n in self.kv_names}
        self.single_sig, self.single_note = self._single(single, sigs, declared)
        self.plan = DecodePlan(self.batch_size or 1)

    def _single(self, name: str | None, sigs: Mapping[str, SignatureInfo],
                declared: Shapes) -> tuple[str | None, str]:
        """The batch-1 decode beside the batched one, if its inputs match (module docstring);
        else None and why it is not used."""
        if name is None or not (self.batch_size and self.batch_size > 1):  # a dynamic batch sizes itself
            return None, ""
        sig, shapes = sigs[name], declared[name]
        kv = sorted(n for n in sig.inputs if n.startswith(KV_PREFIX))
        differs = ("its cache inputs differ" if kv != self.kv_names or
                   any(tuple(shapes[n] or ())[1:] != self.row_shapes[n] for n in kv) else
                   "one has the mask input and the other not" if ("mask" in sig.inputs) != self.has_mask else
                   "it lacks input_pos or logits" if "input_pos" not in sig.inputs or "logits" not in sig.outputs
                   else "")
        return (None, f"{name} not used: {differs}") if differs else (name, "")

    def _details(self) -> JSONObject:
        out: JSONObject = {"prefill_windows": [n or "dynamic" for n, _ in self.prefills], "kv_layout": self.kv_layout,
                           "mask_input": self.has_mask, "shared_position": self.shared_position,
                           "aligned_rows": self.aligned, "decode_signature": self.decode_sig}
        if self.single_sig is not None:
            out.update(batch1_signature=self.single_sig, **self.plan.describe())
        elif self.single_note:
            out["batch1_signature"] = self.single_note
        return out

    def warm_up(self) -> None:
        super().warm_up()
        self.measure()

    def measure(self) -> None:
        """Time one batch-1 and one batched decode call on scratch rows and decide, per group
        size, which runs (runtimes/decode_plan.py). Without a batch-1 decode: nothing to decide."""
        if self.single_sig is None:
            return
        # A full lane each way, as a step runs it: ``batch`` batch-1 calls one after another (on
        # warm weights: timed one at a time between batched calls, a batch-1 call measured ~35 %
        # dearer than in a step, and batching was chosen where it lost, bench/RESULTS.md issue 45)
        # against one batched call, each on a lane of its own (no settling between them).
        rows = list(range(self.batch_size or 1))
        apart, together = self.new_slots(len(rows)), self.new_slots(len(rows))
        apart.clean()  # timed on zeros, as served: never on an unwritten row
        together.clean()
        zeros = [0] * len(rows)
        single_ms, batched_ms = measure(
            lambda: [self._decode_single(apart, row, 0, 1, 0) for row in rows],
            lambda: self._decode_group(together, rows, zeros, [1] * len(rows), zeros, partial=False, batched=True))
        self.plan.decide(single_ms / len(rows), batched_ms)

    def new_slots(self, capacity: int) -> Slots:
        rows = self.batch_size or capacity
        # Unwritten (Slots.blank): a lone stream in a batch-4 lane zeroes its own row only.
        return Slots(rows, {n: np.empty((rows, *self.row_shapes[n]), self.dtypes[n]) for n in self.kv_names},
                     blank=set(range(rows)))

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
        slots.own.pop(row, None)  # what a finished stream left there: overwritten, or masked before start
        slots.clean(row)  # a row never written is zeroed; a finished stream's values are finite, masked
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

    def _decode_single(self, slots: Slots, row: int, token: int, pos: int, start: int) -> np.ndarray:
        """One row through the batch-1 decode, on its own cache row: next-token logits [vocab]."""
        feeds = {"tokens": np.array([[token]], np.int32), "input_pos": np.array([pos], np.int32),
                 **{k: slots.row(k, row) for k in self.kv_names}}
        if self.has_mask:
            feeds["mask"] = self._mask(1, np.array([pos]), np.array([start]))
        out = self._run(self.single_sig or self.decode_sig, feeds)
        slots.own[row] = {k: owned(out[k]) for k in self.kv_names}
        return last_logits(out["logits"], 1)[0]

    def _decode_alone(self, slots: Slots, row: int, token: int, pos: int, start: int = 0) -> None:
        """One prompt token of one row through ``decode``, in a scratch batch: the other rows
        of ``slots`` (other streams, at other positions) must not take this call's writes."""
        if self.single_sig is not None:  # a batch-1 decode writes its one row only
            self._decode_single(slots, row, token, pos, start)
            return
        n = self._rows(1)
        scratch = {k: np.zeros((n, *self.row_shapes[k]), self.dtypes[k]) for k in self.kv_names}
        for k in self.kv_names:
            scratch[k][0] = slots.row(k, row)[0]
        tokens = np.zeros((n, 1), np.int32)
        tokens[0, 0] = token
        positions = np.full(n, pos, np.int32)
        feeds = {"tokens": tokens, "input_pos": positions[:self.pos_rows or n], **scratch}
        if self.has_mask:
            feeds["mask"] = self._mask(n, positions, np.full(n, start))
        out = self._run(self.decode_sig, feeds)
        for k in self.kv_names:
            slots.arrays[k][row] = out[k][0]

    def decode(self, slots: Slots, rows: Sequence[int], tokens: Sequence[int], positions: Sequence[int],
               starts: Sequence[int] | None = None) -> np.ndarray:
        logits = np.empty((len(rows), self.vocab_size), np.float32)
        groups = {p: [i for i, q in enumerate(positions) if q == p] for p in positions} if self.shared_position \
            else {None: list(range(len(rows)))}
        slots.calls = []
        if self.single_sig is not None and not self.plan.measured:
            self.measure()  # a version warmed up by its own requests file was not measured at load
        for position, members in groups.items():
            group = [rows[i] for i in members]
            batched = self.single_sig is None or self.plan.use_batched(len(members))
            logits[members] = self._decode_group(slots, group, [tokens[i] for i in members],
                                                 [positions[i] for i in members],
                                                 [starts[i] for i in members] if starts else None,
                                                 partial=position is not None and len(members) < len(rows),
                                                 batched=batched)
            slots.calls.extend([len(members)] if batched else [1] * len(members))
        return logits

    def _decode_group(self, slots: Slots, rows: list[int], tokens: list[int], positions: list[int],
                      starts: list[int] | None, partial: bool, batched: bool) -> np.ndarray:
        """One step of ``rows``: one call of the batched decode, or (``batched`` False) one call
        of the batch-1 decode per row."""
        if not batched:
            return np.stack([self._decode_single(slots, row, token, pos, starts[i] if starts else 0)
                             for i, (row, token, pos) in enumerate(zip(rows, tokens, positions))])
        n = self._rows(len(rows))
        if self.batch_size is None and rows != list(range(len(rows))):
            raise ValueError(f"a dynamic decode batch runs rows 0..{len(rows) - 1}, got {rows}")
        slots.settle()
        slots.clean()  # the call computes every row: none of them on uninitialized memory
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
        out = self._run(self.decode_sig, feeds)
        for k in self.kv_names:
            if partial:  # a shared position: other rows' caches must not take this call's writes
                slots.arrays[k][rows] = out[k][rows]
            elif n == slots.capacity:
                slots.arrays[k] = owned(out[k])
            else:
                slots.arrays[k][:n] = out[k]
        return last_logits(out["logits"], n)[rows]


def _dim(shape: tuple[int, ...] | None, i: int) -> int | None:
    return shape[i] if shape and len(shape) > i and shape[i] > 0 else None


def _decode_signatures(declared: Shapes) -> tuple[str, str | None]:
    """(the decode that sets the lanes: the largest batch, a dynamic one largest of all; a
    batch-1 decode beside it, or None). ``decode`` itself always counts, even malformed, so that
    what it lacks is named."""
    found = {name: batch_of(shapes.get("tokens")) for name, shapes in declared.items()
             if DECODE_RE.fullmatch(name) and ("tokens" in shapes or name == "decode")}
    batched = max(found, key=lambda n: (found[n] is None, found[n] or 0, n == "decode"))
    single = next((n for n, b in sorted(found.items()) if b == 1 and n != batched), None)
    return batched, single


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
        self.batch_size = batch_of(shapes[self.ids])
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
            slots.arrays["cache"] = owned(out["cache"])
        else:
            slots.arrays["cache"][:n] = out["cache"]
        return last_logits(out["logits"], n)[list(rows)]

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
                logits[part] = last_logits(out["logits"], ids.shape[0])[:len(part)]
        return logits


def declared_shapes(servable: Servable) -> dict[str, dict[str, tuple[int, ...] | None]]:
    """Input shapes as the model declares them (the LiteRT backend keeps generation
    signatures' own shapes: see ``runtimes.tflite``)."""
    return {name: {n: s.shape for n, s in sig.inputs.items()} for name, sig in servable.signatures.items()}


def convention(signatures: Mapping[str, object]) -> str | None:
    """Which convention the signatures follow, by name alone (cheap: no model calls; the values unread)."""
    if "decode" in signatures and any(PREFILL_RE.fullmatch(n) for n in signatures):
        return LiteRTLLM.kind
    if GenerateStep.SIGNATURE in signatures:
        return GenerateStep.kind
    return None


_DRIVERS: "weakref.WeakKeyDictionary[Servable, Driver]" = weakref.WeakKeyDictionary()


def detect(servable: Servable) -> Driver | None:
    """The driver for a servable's generation signatures; None when it has none. One driver per
    servable: what its warm-up measured (``LiteRTLLM.measure``) stays with it.
    Raises ``LoadFailure`` naming what is wrong when the signatures are there but malformed."""
    try:
        known = _DRIVERS.get(servable)
    except TypeError:  # a servable that cannot be weakly referenced: a driver each time
        known = None
    if known is not None:
        return known
    kind = convention(servable.signatures)
    if kind is None:
        return None
    try:
        declared = declared_shapes(servable)
        driver = LiteRTLLM(servable, declared) if kind == LiteRTLLM.kind else GenerateStep(servable, declared)
    except (KeyError, IndexError, TypeError) as exc:
        raise LoadFailure(f"{kind} signatures are malformed: {type(exc).__name__}: {exc}") from exc
    try:
        _DRIVERS[servable] = driver
    except TypeError:
        pass
    return driver


__all__ = ["DEFAULT_LAYOUT", "KV_PREFIX", "TRANSPOSED_LAYOUT", "Driver", "GenerateStep", "LiteRTLLM", "Slots", "cache_layout",
           "convention", "declared_shapes", "detect"]

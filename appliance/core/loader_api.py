"""A version's API (its signatures, their inputs, outputs and dtypes) and what a new version
changes in it.

A new version must serve at least what the version it replaces served: every signature, every
input and output of each (same dtype, a compatible shape), and no input the old one did not
require (TF Serving's Predict refuses a request that does not feed every input of the
signature: "input size does not match signature"). ``differences(old, new)`` names each
break in one sentence; the loader refuses a swap that has any, unless the publisher declared
the change (appliance/core/loader.py ``api_change_declared``).

An API is plain JSON (``{signature: {"method", "inputs": {name: {"dtype", "shape"}},
"outputs": {...}}}``): it crosses from the trial process, and the last good version's is
kept in the state database so that a restart compares with it too. Pure functions; no I/O.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from runtimes import SignatureInfo, TensorSpec

Api = dict[str, dict[str, Any]]


def _tensor(spec: TensorSpec) -> dict[str, Any]:
    dtype = "string" if spec.dtype == np.dtype(object) else np.dtype(spec.dtype).name
    return {"dtype": dtype, "shape": list(spec.shape) if spec.shape is not None else None}


def api_of(signatures: Mapping[str, SignatureInfo]) -> Api:
    """The API of a loaded servable's signatures, as JSON."""
    return {name: {"method": sig.method_name,
                   "inputs": {k: _tensor(v) for k, v in sig.inputs.items()},
                   "outputs": {k: _tensor(v) for k, v in sig.outputs.items()}}
            for name, sig in signatures.items()}


def _shape_text(shape: list[int] | None) -> str:
    return "an unknown shape" if shape is None else "[" + ",".join(str(d) for d in shape) + "]"


def _shapes_fit(old: list[int] | None, new: list[int] | None) -> bool:
    """Whatever fitted ``old`` fits ``new``: unknown rank takes anything; a dimension the new
    version leaves open (-1) takes any size; a fixed one must stay what it was."""
    if new is None:
        return True
    if old is None or len(old) != len(new):
        return False
    return all(n in (-1, None) or o == n for o, n in zip(old, new))


def _tensor_breaks(kind: str, where: str, old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    out = []
    for name, was in old.items():
        now = new.get(name)
        if now is None:
            out.append(f"{where}: {kind} {name!r} is gone")
        elif now["dtype"] != was["dtype"]:
            out.append(f"{where}: {kind} {name!r} is {now['dtype']} now, was {was['dtype']}")
        elif not _shapes_fit(was.get("shape"), now.get("shape")):
            out.append(f"{where}: {kind} {name!r} is {_shape_text(now.get('shape'))} now, "
                       f"was {_shape_text(was.get('shape'))}")
    return out


def differences(old: Api, new: Api) -> list[str]:
    """Every way ``new`` serves less than ``old`` (empty: compatible), one sentence each."""
    out = []
    for name, was in sorted(old.items()):
        now = new.get(name)
        if now is None:
            out.append(f"signature {name!r} is gone")
            continue
        where = f"signature {name!r}"
        out += _tensor_breaks("input", where, was.get("inputs", {}), now.get("inputs", {}))
        out += _tensor_breaks("output", where, was.get("outputs", {}), now.get("outputs", {}))
        added = sorted(set(now.get("inputs", {})) - set(was.get("inputs", {})))
        if added:
            out.append(f"{where}: requires input{'s' if len(added) > 1 else ''} "
                       f"{', '.join(repr(a) for a in added)} that clients of the old version do not send")
    return out


__all__ = ["Api", "api_of", "differences"]

"""Triton's classification extension: an output answered as its top N classes.

A request asks for it per output (REST ``{"name": "probs", "parameters": {"classification":
3}}``, gRPC the output parameter ``classification``, what tritonclient's ``class_count`` sets).
The answer replaces the output's values with a BYTES tensor of ``"score:index"`` strings, or
``"score:index:label"`` when the version has labels, highest score first, one row of N per
batch item (shape ``[batch, N]``; ``[N]`` for an output without a batch dimension), as
Triton's core writes them (the score as C++'s ``std::to_string``: six decimals).

Labels: Triton reads the file a model's config.pbtxt names in ``label_filename``, one label
per line, line i the label of class i. Here a version has no config.pbtxt: its label file is
``labels.txt`` in the version directory, else ``assets/labels.txt`` (a SavedModel's assets),
read once per version (versions never change once committed).
"""

from __future__ import annotations

import functools
import os

import numpy as np

from appliance.core.errors import InvalidArgument

LABEL_FILES = ("labels.txt", os.path.join("assets", "labels.txt"))  # in the version directory, first found


def label_file(version_dir: str) -> str | None:
    """The version's label file name (relative), or None."""
    for name in LABEL_FILES:
        if os.path.isfile(os.path.join(version_dir, name)):
            return name
    return None


@functools.lru_cache(maxsize=64)
def labels(version_dir: str) -> tuple[str, ...]:
    """The version's labels, one per line (none when it has no label file)."""
    name = label_file(version_dir)
    if name is None:
        return ()
    with open(os.path.join(version_dir, name), encoding="utf-8", errors="replace") as f:
        return tuple(line.rstrip("\r\n") for line in f)


def count(value: object, where: str) -> int:
    """A request's ``classification`` parameter: a positive integer."""
    if type(value) is not int or value < 0:
        raise InvalidArgument(f"{where}: parameter 'classification' must be a non-negative integer, got {value!r}")
    return value


def top(arr: np.ndarray, n: int, names: tuple[str, ...], output: str) -> np.ndarray:
    """The top ``n`` classes of each row of ``arr`` as Triton's strings (module docstring)."""
    if arr.dtype.kind not in "biuf":
        raise InvalidArgument(f"output '{output}': classification needs a numeric output, it is {arr.dtype.name}")
    rows = arr.reshape(arr.shape[0], -1) if arr.ndim > 1 else arr.reshape(1, -1)
    n = min(n, rows.shape[1])
    order = np.argsort(-rows.astype(np.float64), axis=1, kind="stable")[:, :n]
    out = np.empty(order.shape, dtype=object)
    for r, indices in enumerate(order):
        for c, i in enumerate(indices):
            label = f":{names[i]}" if i < len(names) and names[i] else ""
            out[r, c] = f"{float(rows[r, i]):f}:{int(i)}{label}".encode()
    return out if arr.ndim > 1 else out.reshape(-1)


__all__ = ["LABEL_FILES", "count", "label_file", "labels", "top"]

"""litert-torch's KV cache layouts, and which one a decode signature's declared shapes use."""

from __future__ import annotations

from typing import Mapping, Sequence

from .base import LoadFailure

KV_PREFIX = "kv_cache_"

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


__all__ = ["DEFAULT_LAYOUT", "KV_PREFIX", "TRANSPOSED_LAYOUT", "cache_layout"]

"""``appliance tfs``'s start-up order: the ports open once the configured models are available.

tensorflow_model_server builds its ServerCore (``ServerCore::WaitUntilModelsAvailable``: the
latest version of every configured model AVAILABLE) before it opens a port, so a client that
waits for the port and calls at once is answered. ``[tfs] wait_for_models`` (set by ``appliance
tfs``) does the same here: the core starts, the models load, and only then do REST and gRPC
bind. ``appliance serve`` keeps its own order (ports at once, ``/readyz`` says when ready).

Where TF Serving would wait for ever (its ``servable_state_waiter_timeout`` is infinite) this
waits ``[tfs] wait_for_models_timeout_s`` at most. A configured model whose versions all failed
to load, or the deadline passing, ends start-up with TF Serving's text ("N model(s) did not
become available: {...}"): the process exits 1, as tensorflow_model_server exits, and nothing
was ever listening.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Mapping

from appliance.core.json_read import int_or_none, obj, objs
from appliance.core.json_types import ReadJSONObject, ReadJSONValue
from appliance.core.policy import State

if TYPE_CHECKING:
    from appliance.core.manager import Manager

POLL_S = 0.1
_PENDING = (State.START.value, State.LOADING.value)


def wait_for_models(manager: Manager | None, timeout_s: float, stopping: Callable[[], bool]) -> str | None:
    """None once every configured model has an AVAILABLE version (or ``stopping()`` says the
    service is stopping); else why not, in TF Serving's words: a model that failed to load
    (every version ended, at least one quarantined) at once, the ones still missing at the
    deadline otherwise. ``manager``: the core's, started (its source has pushed the models);
    None where the core has none (no model configured: nothing to wait for)."""
    deadline = time.monotonic() + timeout_s
    while manager is not None and not stopping():
        models = manager.snapshot()
        missing = {name: obj(m) for name, m in models.items() if obj(m)["serving_version"] is None}
        if not missing:
            return None
        failed = {name: m for name, m in missing.items() if _failed(m)}
        if failed:
            return not_available(failed)
        if time.monotonic() >= deadline:
            return not_available(missing, f" within [tfs] wait_for_models_timeout_s = {timeout_s:g} s")
        time.sleep(POLL_S)
    return None


def _failed(model: ReadJSONObject) -> bool:
    """Every version has ended and one of them is quarantined: nothing more will load until
    its files change."""
    return bool(model["quarantined"]) and not any(v["state"] in _PENDING for v in objs(model["versions"]))


def not_available(models: Mapping[str, ReadJSONObject], when: str = "") -> str:
    """``ServerCore::WaitUntilModelsAvailable``'s error text, one ``{name: .. version: ..}`` per
    model (its newest version, or the newest that failed), with the load error where there is one."""
    parts = []
    for name, model in sorted(models.items()):
        quarantine = obj(model.get("quarantine"))
        numbers = (int_or_none(v["version"]) for v in objs(model["versions"]))
        versions = [n for n in numbers if n is not None] + [int(v) for v in quarantine]
        version = max(versions) if versions else "none on disk"
        reason: ReadJSONValue = obj(quarantine.get(str(version))).get("reason") or next(
            (v["error"] for v in objs(model["versions"]) if v.get("error")), "")
        parts.append(f"{{{{name: {name} version: {version}}}{' due to error: ' + str(reason) if reason else ''}}}, ")
    return f"{len(parts)} model(s) did not become available{when}: {{{''.join(parts)}}}"

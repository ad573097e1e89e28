"""Triton's statistics, model configuration and model repository extensions, protocol-neutral.

The REST face (appliance/api/kserve/rest.py) and the gRPC face (grpc_service.py) render what
``V2Extensions`` returns; the shapes are Triton's JSON (its HTTP API), which the gRPC face
parses into Triton's messages (``ModelStatistics``, ``ModelConfig``, ``RepositoryIndex``).

* **statistics**: every loaded version's figures from the serving path
  (appliance/core/inference_stats.py: the same two events the Prometheus series count);
* **model configuration**: derived, since there is no config.pbtxt: inputs and outputs of the
  model's default signature with Triton's ``TYPE_*`` names and dims without the batch
  dimension, ``max_batch_size`` the batching config's when batching is on and every tensor
  has a batch dimension (else 0, as Triton's "no batching"), ``dynamic_batching`` from
  ``[batching]`` (the model's overrides merged), the version policy of the model's settings;
* **repository**: index, load and unload through appliance/core/model_control.py (Triton's
  explicit model-control mode, ``[kserve] model_control``).

Only the serving process answers these (a front worker forwards them). Thread-safety: as
``V2Service``: no state of its own.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Mapping

from runtimes import SignatureInfo, TensorSpec

from appliance.api.kserve import codec
from appliance.api.kserve.classification import label_file
from appliance.api.kserve.service import default_signature, triton_words
from appliance.core.config import BatchingConfig, ModelConfig
from appliance.core.errors import ApplianceError, InvalidArgument, NotFound, Unavailable, Unimplemented
from appliance.core.json_types import JSONArray, JSONObject, JSONValue
from appliance.core.policy import State

if TYPE_CHECKING:
    from appliance.core.appliance import Appliance
    from appliance.core.manager import Manager
    from appliance.core.model_control import ModelControl

# Triton's words: tritonclient's and Triton's model-control examples check "failed to load"
LOAD_FAILED = "failed to load '{name}'"
LOAD_POLL_S = 0.05


class V2Extensions:
    """Statistics, model configuration and repository (module docstring)."""

    def __init__(self, core: "Appliance"):
        self.core = core

    # -- statistics ---------------------------------------------------------------------------
    def statistics(self, name: str, version: int | None) -> dict[str, list[dict[str, object]]]:
        """``{"model_stats": [...]}`` for every loaded version of ``name`` (every model when
        empty), or the one version asked for."""
        manager = self._manager()
        names = [name] if name else manager.models()
        entries: list[dict[str, object]] = []
        for model in names:
            with triton_words(model, version):
                slots = manager.version_states(model, version)
            for slot in sorted(slots, key=lambda s: s.version):
                if slot.state == State.AVAILABLE or version is not None:
                    figures = self.core.metrics.inference.of(model, slot.version)
                    entries.append({"name": model, "version": str(slot.version), **figures})
        return {"model_stats": entries}

    # -- model configuration -----------------------------------------------------------------
    async def config(self, name: str, version: int | None) -> JSONObject:
        manager = self._manager()
        with triton_words(name, version):
            settings = manager.entry(name).config
            held_handle = await self.core.handles.handle(name, version)
        with held_handle as held:
            signature = default_signature(held)
            platform, path = held.platform, held.path
        control = self.core.control
        settings = (control.config_of(name) if control is not None else None) or settings
        return model_config(name, platform, settings, self.core.config.batching_for(settings), signature, path)

    # -- repository -----------------------------------------------------------------------------
    def index(self, ready_only: bool = False) -> list[JSONObject]:
        """Triton's repository index: one entry per loaded version (its state), and one per
        model not loaded (``UNAVAILABLE``, "unloaded")."""
        control, manager = self.core.control, self._manager()
        out: list[JSONObject] = []
        for name, loaded in (control.index() if control is not None else [(n, True) for n in manager.models()]):
            try:
                slots = manager.version_states(name) if loaded else []
            except NotFound:  # asked for, not pushed to the manager yet
                slots = []
            for slot in sorted(slots, key=lambda s: s.version):
                state = _STATE_WORDS.get(slot.state, "UNAVAILABLE")
                if not ready_only or state == "READY":
                    out.append({"name": name, "version": str(slot.version), "state": state,
                                "reason": slot.error if state == "UNAVAILABLE" else ""})
            if not slots and not ready_only:
                out.append({"name": name, "state": "UNAVAILABLE", "reason": "unloaded"})
        return out

    async def load(self, name: str, parameters: Mapping[str, object]) -> None:
        """Triton's load: returns once the model is ready, or fails with "failed to load"."""
        control = self._control()
        _check_explicit(control)
        _refuse_files(name, parameters)
        batching = _config_override(name, parameters)
        control.load(name, batching)
        await self._until(name, loaded=True)

    async def unload(self, name: str, parameters: Mapping[str, object]) -> None:
        control = self._control()
        _check_explicit(control)
        control.unload(name)
        await self._until(name, loaded=False)

    async def _until(self, name: str, loaded: bool) -> None:
        """Wait (bounded by ``runtime.load_timeout_s``) until ``name`` is ready, or gone."""
        deadline = time.monotonic() + self.core.config.runtime.load_timeout_s
        manager = self._manager()
        while True:
            try:
                slots = manager.version_states(name)
            except NotFound:
                slots = []
            if not loaded and not slots:
                return
            if loaded and any(s.state == State.AVAILABLE for s in slots):
                return
            quarantined = _quarantined(manager, name) if loaded else []
            if quarantined and not any(s.state in (State.START, State.LOADING, State.AVAILABLE) for s in slots):
                raise InvalidArgument(f"{LOAD_FAILED.format(name=name)}: {'; '.join(quarantined)}")
            if time.monotonic() > deadline:
                raise Unavailable(f"{name} is not {'ready' if loaded else 'unloaded'} after "
                                  f"runtime.load_timeout_s = {self.core.config.runtime.load_timeout_s:g} s")
            await asyncio.sleep(LOAD_POLL_S)

    def _manager(self) -> "Manager":
        manager = self.core.manager
        if manager is None:
            raise Unavailable("the model manager is not running")
        return manager

    def _control(self) -> "ModelControl":
        control = self.core.control
        if control is None:
            raise Unavailable("the model manager is not running")
        return control


def _check_explicit(control: "ModelControl") -> None:
    """Load and unload outside explicit mode: UNAVAILABLE (503), in Triton's words and with
    Triton's code (its qa checks both)."""
    if not control.explicit:
        from appliance.core.model_control import NOT_EXPLICIT

        raise Unavailable(f"{NOT_EXPLICIT}: this server runs with [kserve] model_control = \"none\"; set it to "
                          "\"explicit\" to load and unload models through the repository API")


def _quarantined(manager: "Manager", name: str) -> list[str]:
    """Why each version of ``name`` failed to load, if any did."""
    try:
        return [f"version {v}: {q.reason}" for v, q in sorted(manager.entry(name).quarantined.items())]
    except NotFound:
        return []


_STATE_WORDS = {State.AVAILABLE: "READY", State.LOADING: "LOADING", State.START: "LOADING",
                State.UNLOADING: "UNLOADING"}
_OVERRIDABLE = {"max_batch_size": "max_batch_size"}  # Triton config key -> our [batching] key


NAME_MAX = 255  # a path component's limit (Linux): Triton refuses a longer file name as INTERNAL


def _refuse_files(name: str, parameters: Mapping[str, object]) -> None:
    """Triton's load may carry the model's files (``file:<path>`` parameters, with a config):
    this server loads only what its sources have on disk (verified, atomically committed), so
    it refuses them; a path Triton itself refuses (a component over NAME_MAX) gets Triton's answer."""
    files = [key for key in parameters if key.startswith("file:")]
    for key in files:
        if any(len(part) > NAME_MAX for part in key[len("file:"):].split("/")):
            raise ApplianceError(f"{LOAD_FAILED.format(name=name)}: failed to poll from model repository: "
                                 f"a path component of '{key[:80]}...' is longer than {NAME_MAX} bytes")
    if files:
        raise Unimplemented(f"{LOAD_FAILED.format(name=name)}: model files in the load request ({files[0]}) are "
                            "not supported here; put the version folder in the model repository (or publish it to "
                            "the bucket) and load it by name")


def _config_override(name: str, parameters: Mapping[str, object]) -> dict[str, int] | None:
    """A load's ``config`` parameter (Triton: a model configuration as JSON) as ``[batching]``
    overrides; the keys it may set are ``max_batch_size`` and ``dynamic_batching``'s
    ``max_queue_delay_microseconds``. Anything else is refused, naming the key."""
    text = parameters.get("config")
    if text is None:
        return None
    import orjson

    try:
        value: JSONValue = orjson.loads(text) if isinstance(text, (str, bytes)) else None
    except orjson.JSONDecodeError as exc:
        raise InvalidArgument(f"{LOAD_FAILED.format(name=name)}: the 'config' parameter is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{LOAD_FAILED.format(name=name)}: the 'config' parameter must be a JSON object")
    out: dict[str, int] = {}
    for key, item in value.items():
        if key == "max_batch_size":
            out["max_batch_size"] = _int(name, key, item)
        elif key == "dynamic_batching" and isinstance(item, dict) and set(item) <= {"max_queue_delay_microseconds"}:
            if "max_queue_delay_microseconds" in item:
                out["batch_timeout_micros"] = _int(name, key, item["max_queue_delay_microseconds"])
        elif key != "name":
            raise InvalidArgument(f"{LOAD_FAILED.format(name=name)}: config key '{key}' cannot be overridden here; "
                                  "max_batch_size and dynamic_batching.max_queue_delay_microseconds can")
    return out


def _int(name: str, key: str, item: JSONValue) -> int:
    try:
        if not isinstance(item, (str, int, float)):  # as int() of it: a TypeError
            raise TypeError(type(item).__name__)
        return int(item)  # Triton's JSON takes "16" for an int64 as protobuf's JSON does
    except (TypeError, ValueError):
        raise InvalidArgument(f"{LOAD_FAILED.format(name=name)}: config '{key}' must be an integer") from None


# --- Triton's model configuration ---------------------------------------------------------------
def model_config(name: str, platform: str, settings: ModelConfig, batching: BatchingConfig, signature: SignatureInfo,
                 path: str) -> JSONObject:
    """Triton's ModelConfig (its JSON) of a served version (module docstring)."""
    specs = [*signature.inputs.values(), *signature.outputs.values()]
    batched = batching.enable_batching and all(_has_batch_dim(s) for s in specs)
    labels = label_file(path)
    outputs: JSONArray = [{**_tensor(k, s, batched, False), "label_filename": labels or ""}
                          for k, s in signature.outputs.items()]
    body: JSONObject = {
        "name": name, "platform": platform,
        "backend": "tensorflow" if platform.startswith("tensorflow") else platform,
        "version_policy": _version_policy(settings),
        "max_batch_size": batching.max_batch_size if batched else 0,
        "input": [_tensor(k, s, batched, True) for k, s in signature.inputs.items()],
        "output": outputs,
        "instance_group": [{"name": f"{name}_0", "kind": "KIND_CPU", "count": 1}],
        "parameters": {},
    }
    if batched:
        body["dynamic_batching"] = {"preferred_batch_size": list(batching.allowed_batch_sizes),
                                    "max_queue_delay_microseconds": batching.batch_timeout_micros}
    return body


def _version_policy(settings: ModelConfig) -> JSONObject:
    if settings.version_policy == "all":
        return {"all": {}}
    if settings.version_policy == "specific":
        return {"specific": {"versions": list(settings.versions)}}
    return {"latest": {"num_versions": settings.latest}}


def _has_batch_dim(spec: TensorSpec) -> bool:
    return spec.shape is not None and len(spec.shape) >= 1 and spec.shape[0] in (None, -1)


def _tensor(name: str, spec: TensorSpec, batched: bool, is_input: bool) -> JSONObject:
    dims: JSONArray = [-1] if spec.shape is None else [-1 if d is None else int(d) for d in spec.shape]
    if batched:
        dims = dims[1:]
    out: JSONObject = {"name": name, "data_type": "TYPE_" + _type_word(codec.datatype_of(spec.dtype)),
                           "dims": dims}
    if is_input:  # an image-shaped input (H, W, 1 or 3) is NHWC, what image_client.py needs to know
        image = len(dims) == 3 and dims[2] in (1, 3)
        out["format"] = "FORMAT_NHWC" if image else "FORMAT_NONE"
    return out


def _type_word(datatype: str) -> str:
    return "STRING" if datatype == "BYTES" else datatype


__all__ = ["V2Extensions", "model_config"]

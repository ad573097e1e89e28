"""What serves, as plain data: the view a front worker decodes requests against.

A front worker (appliance/fronts/) parses and decodes requests in a process of its
own, so it needs, for every model, the signatures of the versions a request may reach and
which version an unversioned or labelled request gets; it never holds a version. This is
that view, built from the manager's public read side and small enough to send on every
change (the serving process pushes it when the manager says what serves has changed). It is
advice, not authority: the serving process resolves every request again through
``manager.handle`` and runs inputs only on a version whose signature takes them
(appliance/fronts/serving.py), so a stale view never gives a wrong answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from runtimes import SignatureInfo, TensorSpec

from appliance.core.policy import State

if TYPE_CHECKING:
    from appliance.core.manager import Manager


@dataclass(frozen=True)
class VersionView:
    version: int
    path: str
    platform: str
    reads_examples: bool
    signatures: Mapping[str, SignatureInfo]


@dataclass(frozen=True)
class ModelView:
    labels: Mapping[str, int]
    versions: Mapping[int, VersionView]  # AVAILABLE ones
    serving: int | None  # what an unversioned request gets (None: nothing AVAILABLE)
    route_headers: tuple[str, ...] = ()  # headers a canary rollout routes on (sticky keys)


@dataclass(frozen=True)
class ServingView:
    generation: int
    models: Mapping[str, ModelView] = field(default_factory=dict)


def _plain(signature: SignatureInfo) -> SignatureInfo:
    return SignatureInfo(signature.name, {k: _spec(v) for k, v in signature.inputs.items()},
                         {k: _spec(v) for k, v in signature.outputs.items()}, signature.method_name)


def _spec(spec: TensorSpec) -> TensorSpec:
    return TensorSpec(spec.name, spec.dtype, None if spec.shape is None else tuple(spec.shape), spec.tensor_name)


def version_view(version: int, path: str, platform: str, reads_examples: bool,
                 signatures: Mapping[str, SignatureInfo]) -> VersionView:
    plain = {k: _plain(v) for k, v in signatures.items()}
    return VersionView(version, path, platform, reads_examples, plain)


def build(manager: "Manager", generation: int) -> ServingView:
    """The view of what ``manager`` serves now."""
    models = {}
    for name in manager.models():
        try:
            entry = manager.entry(name)
        except Exception:  # removed meanwhile
            continue
        versions = {}
        for slot in list(entry.versions.values()):
            servable = slot.servable
            if slot.state != State.AVAILABLE or servable is None:
                continue
            versions[slot.version] = version_view(
                slot.version, slot.path, str(getattr(servable, "platform", "") or getattr(servable, "backend", "")),
                bool(servable.reads_examples), servable.signatures)
        serving = entry.serving if entry.serving in versions else max(versions, default=None)
        policy = manager.rollout_policy(name)
        headers = (policy.sticky_header,) if policy is not None and policy.mode == "canary" and policy.sticky_header \
            else ()
        models[name] = ModelView(dict(entry.config.labels), versions, serving, headers)
    return ServingView(generation, models)

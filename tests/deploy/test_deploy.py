"""The deployment files (issue 32), checked offline by the tools their platforms trust.

- Kubernetes (deploy/kubernetes/): ``kubernetes-validate --strict``, Kubernetes' own OpenAPI
  schemas as that package ships them, for the newest release it knows; strict means an unknown
  field is an error, where the API server would drop it without a word.
- KServe (deploy/kserve/): ``check-jsonschema`` against the schemas of KServe's own CRDs
  (``openAPIV3Schema``, made strict; tests/data/kserve/vendor_schemas.py says from which commit).
- Compose (compose.yaml): ``check-jsonschema --builtin-schema vendor.compose-spec``, the Compose
  Specification's schema as check-jsonschema vendors it.
- Quadlet (systemd/edge-appliance.container): podman's own generator (``quadlet -dryrun``)
  writes the service, and ``systemd-analyze verify`` checks that.

Each validator is also shown a broken copy, so a validator that accepted anything would fail here.
No cluster runs here: what a real one would add (scheduling, the kubelet's hostPath, KServe's
storage initializer) is not covered.
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.servers import ROOT

BIN = Path(sys.executable).parent
K8S = ROOT / "deploy" / "kubernetes" / "edge-appliance.yaml"
KSERVE = {"ServingRuntime": (ROOT / "deploy" / "kserve" / "servingruntime.yaml", "servingruntime-v1alpha1"),
          "InferenceService": (ROOT / "deploy" / "kserve" / "inferenceservice.yaml", "inferenceservice-v1beta1")}
COMPOSE = ROOT / "compose.yaml"
QUADLET_UNIT = ROOT / "systemd" / "edge-appliance.container"
UID = "10001"


def run(*cmd: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=240,
                          env={**os.environ, **(env or {})})


# --- Kubernetes ------------------------------------------------------------------------------------
def test_the_kubernetes_manifests_pass_strict_validation() -> None:
    done = run(BIN / "kubernetes-validate", "--strict", K8S)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(" passed for resource ") == 3, done.stdout  # Namespace, ConfigMap, DaemonSet


def test_strict_kubernetes_validation_catches_a_misspelt_field(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text(K8S.read_text().replace("readinessProbe:", "readynessProbe:"))
    done = run(BIN / "kubernetes-validate", "--strict", broken)
    assert done.returncode != 0 and "readynessProbe" in done.stdout + done.stderr, done.stdout + done.stderr


def test_the_daemonset_is_what_the_image_expects() -> None:
    daemonset = next(d for d in yaml.safe_load_all(K8S.read_text()) if d["kind"] == "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    main = pod["containers"][0]
    assert str(pod["securityContext"]["runAsUser"]) == UID and pod["hostNetwork"] is True
    assert main["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert main["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert main["lifecycle"]["preStop"] and main["resources"]["requests"] and main["resources"]["limits"]
    assert {p["containerPort"] for p in main["ports"]} == {8501, 8500}
    state = next(v for v in pod["volumes"] if v["name"] == "state")
    assert state["hostPath"]["path"] == "/var/lib/edge-appliance"
    assert pod["initContainers"][0]["command"] == ["chown", f"{UID}:{UID}", "/var/lib/edge-appliance"]
    assert pod["terminationGracePeriodSeconds"] > 20 + 5  # the drain, after the preStop pause


def test_the_rollout_controller_manifest_and_unit_run_the_controller(tmp_path: Path) -> None:
    from appliance.cli import build_parser

    manifest = ROOT / "deploy" / "kubernetes" / "rollout-controller.yaml"
    done = run(BIN / "kubernetes-validate", "--strict", manifest)
    assert done.returncode == 0 and done.stdout.count(" passed for resource ") == 2, done.stdout + done.stderr
    deployment = next(d for d in yaml.safe_load_all(manifest.read_text()) if d["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    args = build_parser().parse_args(deployment["spec"]["template"]["spec"]["containers"][0]["args"])
    assert args.command == "rollout controller" and args.model == "det" and args.channel == "stable"
    unit = ROOT / "systemd" / "edge-appliance-rollout@.service"
    assert "appliance rollout controller --bucket ${BUCKET} --model ${MODEL} --channel ${CHANNEL}" in unit.read_text()
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    instance = tmp_path / "edge-appliance-rollout@det-stable.service"
    instance.write_text(unit.read_text())
    verify = run("systemd-analyze", "verify", "--man=no", instance)
    problems = [line for line in (verify.stdout + verify.stderr).splitlines()
                if instance.name in line and "/opt/edge-appliance" not in line]  # not installed here
    assert not problems, verify.stdout + verify.stderr


# --- KServe --------------------------------------------------------------------------------------
def _schema(tmp_path: Path, name: str) -> Path:
    out = tmp_path / f"{name}.json"
    with gzip.open(ROOT / "tests" / "data" / "kserve" / f"{name}.json.gz", "rb") as f:
        out.write_bytes(f.read())
    return out


@pytest.mark.parametrize("kind", sorted(KSERVE))
def test_the_kserve_examples_pass_kserves_own_schema(kind: str, tmp_path: Path) -> None:
    path, schema = KSERVE[kind]
    assert yaml.safe_load(path.read_text())["kind"] == kind
    done = run(BIN / "check-jsonschema", "--schemafile", _schema(tmp_path, schema), path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_kserve_validation_catches_a_misspelt_field(tmp_path: Path) -> None:
    path, schema = KSERVE["ServingRuntime"]
    broken = tmp_path / "broken.yaml"
    broken.write_text(path.read_text().replace("supportedModelFormats:", "supportedModelFormat:"))
    done = run(BIN / "check-jsonschema", "--schemafile", _schema(tmp_path, schema), broken)
    assert done.returncode != 0 and "supportedModelFormat" in done.stdout, done.stdout + done.stderr


def test_the_serving_runtime_serves_the_inference_service() -> None:
    runtime = yaml.safe_load(KSERVE["ServingRuntime"][0].read_text())
    isvc = yaml.safe_load(KSERVE["InferenceService"][0].read_text())
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    args = runtime["spec"]["containers"][0]["args"]
    assert args[:3] == ["serve", "--models", "/mnt/models"]  # where KServe's storage initializer puts it
    assert args[args.index("--port") + 1] == str(runtime["spec"]["containers"][0]["ports"][0]["containerPort"])


# --- Compose ---------------------------------------------------------------------------------------
def test_compose_file_passes_the_compose_specification() -> None:
    done = run(BIN / "check-jsonschema", "--builtin-schema", "vendor.compose-spec", COMPOSE)
    assert done.returncode == 0, done.stdout + done.stderr
    service = yaml.safe_load(COMPOSE.read_text())["services"]["edge-appliance"]
    assert "state:/var/lib/edge-appliance" in service["volumes"] and service["read_only"] is True


def test_compose_validation_catches_a_misspelt_field(tmp_path: Path) -> None:
    broken = tmp_path / "compose.yaml"
    broken.write_text(COMPOSE.read_text().replace("stop_grace_period:", "stop_grace_periods:"))
    done = run(BIN / "check-jsonschema", "--builtin-schema", "vendor.compose-spec", broken)
    assert done.returncode != 0, done.stdout


# --- Quadlet ---------------------------------------------------------------------------------------
def find_quadlet() -> str | None:
    """podman's Quadlet generator: $QUADLET, podman 4.4+'s own, or the one scripts/test.sh
    takes from Debian's podman package when the installed podman is older. Looked up once, at
    import: the tests run with a private HOME (conftest's private_home), not the user's."""
    for candidate in (os.environ.get("QUADLET", ""), "/usr/libexec/podman/quadlet",
                      os.path.expanduser("~/.cache/edge-appliance/quadlet/usr/libexec/podman/quadlet")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


QUADLET = find_quadlet()


@pytest.mark.skipif(QUADLET is None, reason="no Quadlet generator (podman 4.4+; scripts/test.sh fetches one)")
def test_the_quadlet_unit_generates_a_service_systemd_accepts(tmp_path: Path) -> None:
    done = run(QUADLET or "", "-dryrun", env={"QUADLET_UNIT_DIRS": str(QUADLET_UNIT.parent)})
    assert done.returncode == 0, done.stderr
    assert "---edge-appliance.service---" in done.stdout, done.stdout
    service = done.stdout.split("---edge-appliance.service---", 1)[1].split("\n---", 1)[0]
    exec_start = next(line for line in service.splitlines() if line.startswith("ExecStart="))
    for flag in ("--sdnotify=container", "--network host", "-v edge-appliance-state:/var/lib/edge-appliance",
                 "--read-only", "--cap-drop all", "--stop-timeout=30", "localhost/edge-appliance:lite serve"):
        assert flag in exec_start, (flag, exec_start)
    assert "Type=notify" in service and "RestartPreventExitStatus=2" in service
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    unit = tmp_path / "edge-appliance.service"
    unit.write_text(service.replace(f"SourcePath={QUADLET_UNIT}\n", ""))
    verify = run("systemd-analyze", "verify", "--man=no", unit)
    problems = [line for line in (verify.stdout + verify.stderr).splitlines()
                if str(unit) in line and "podman" not in line]  # /usr/bin/podman may be absent
    assert not problems, verify.stdout + verify.stderr


def test_a_broken_quadlet_unit_is_refused(tmp_path: Path) -> None:
    if QUADLET is None:
        pytest.skip("no Quadlet generator")
    (tmp_path / "edge-appliance.container").write_text(QUADLET_UNIT.read_text().replace("Image=", "Imag="))
    done = run(QUADLET or "", "-dryrun", env={"QUADLET_UNIT_DIRS": str(tmp_path)})
    assert "---edge-appliance.service---" not in done.stdout
    assert "Image" in done.stderr or "Imag" in done.stderr, done.stderr

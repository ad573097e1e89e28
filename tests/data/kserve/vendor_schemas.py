"""Make the JSON schemas tests/deploy/test_deploy.py validates the KServe examples against.

KServe publishes its resources' schemas only inside its CRDs (``openAPIV3Schema``), the schema
the API server itself enforces. This takes them from a checkout of kserve/kserve
(``config/crd/full/serving.kserve.io_{servingruntimes,inferenceservices}.yaml``) and writes one
JSON Schema per served version, gzipped (the InferenceService one holds whole pod specs: 2 MB
as YAML). As kubeconform's ``openapi2jsonschema.py -strict`` does, every object that lists its
properties and does not say ``x-kubernetes-preserve-unknown-fields`` gets
``additionalProperties: false``: a misspelt field is an error here, where the API server would
drop it without a word.

    python3 tests/data/kserve/vendor_schemas.py KSERVE_CHECKOUT [COMMIT]
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from typing import Any

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
CRDS = {"servingruntime": "serving.kserve.io_servingruntimes.yaml",
        "inferenceservice": "serving.kserve.io_inferenceservices.yaml"}


def strict(node: Any) -> Any:
    if isinstance(node, dict):
        node = {k: strict(v) for k, v in node.items()}
        if "properties" in node and "additionalProperties" not in node \
                and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        return node
    if isinstance(node, list):
        return [strict(v) for v in node]
    return node


def main(checkout: str, commit: str) -> None:
    for kind, name in CRDS.items():
        with open(os.path.join(checkout, "config", "crd", "full", name)) as f:
            crd = yaml.safe_load(f)
        for version in crd["spec"]["versions"]:
            schema = strict(version["schema"]["openAPIV3Schema"])
            schema["$comment"] = f"kserve/kserve {commit} config/crd/full/{name}, {version['name']} (strict)"
            out = os.path.join(HERE, f"{kind}-{version['name']}.json.gz")
            with gzip.open(out, "wt") as f:
                json.dump(schema, f, separators=(",", ":"), sort_keys=True)
            print(out, os.path.getsize(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "unknown")

"""/openapi.json is the contract: schemathesis runs every operation against the real server,
with a bounded number of generated requests each, and finds no 5xx, no undocumented status,
no undocumented content type and no body that violates the documented schema."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import (content_type_conformance, not_a_server_error, response_schema_conformance,
                                 status_code_conformance)

from appliance.version import __version__
from appliance.api import openapi

ADMIN_TOKEN = "contract-test-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES_PER_OPERATION = 8  # ~70 operations: about a minute on a small machine
# The description this code serves; test_the_served_description_is_this_one ties it to the server.
SCHEMA = schemathesis.openapi.from_dict(json.loads(json.dumps(openapi.spec(__version__))))


@pytest.fixture(scope="module")
def server(module_server: Any, models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    config = tmp_path_factory.mktemp("contract-config") / "appliance.toml"
    models = "".join(f'[[models]]\nname = "{name}"\nbase_path = "{models_dir / name}"\n'
                     for name in ("half_plus_two", "keras_mlp_tflite"))
    config.write_text(f'poll_interval_s = 5.0\n[discovery]\nenabled = false\n[server]\nmax_body_bytes = 262144\n'
                      f'[security]\nadmin_token = "{ADMIN_TOKEN}"\n{models}')
    return module_server("--config", str(config), timeout=180)


def test_the_served_description_is_this_one(server: Any) -> None:
    assert server.get("/openapi.json").json() == SCHEMA.raw_schema


def test_every_endpoint_is_described(server: Any) -> None:
    paths = SCHEMA.raw_schema["paths"]
    for path in ("/v1/models/{model}", "/v1/models/{model}/versions/{version}/metadata",
                 "/v1/models/{model}/labels/{label}:predict", "/v1/models/{model}:classify",
                 "/v1/models/{model}:regress", "/healthz", "/readyz", "/api/status", "/api/sync", "/api/reload",
                 "/api/models/{model}/rollback", "/monitoring/prometheus/metrics", "/openapi.json",
                 "/v1/models/{model}:generate", "/v1/chat/completions", "/v1/completions", "/v1/models"):
        assert path in paths, path
    from appliance.api.kserve import rest as v2_rest

    assert set(v2_rest.OPENAPI_PATHS) <= set(paths)  # the API layers' own paths are merged in
    assert "401" in paths["/v2/models/{model}/infer"]["post"]["responses"]  # with the auth layer's answers


@SCHEMA.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, derandomize=True,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
def test_the_server_keeps_the_contract(case: Any, server: Any) -> None:
    case.call_and_validate(base_url=server.url, headers=AUTH, checks=CHECKS, timeout=60)

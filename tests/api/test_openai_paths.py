"""OpenAI's ``/v1/embeddings`` and ``/v1/models`` on the async path, like the completions (issue
45): the front path takes them on its event loop (``FrontApp.route`` returns their coroutine,
never the WSGI fallback's thread): in a front worker forwarded to the serving process and awaited
(``ForwardedStreams``), in the serving process answered by ``OpenAIAPI`` itself, an
``AsyncFamily``. What they answer is tests/api/test_openai.py's and test_openai_embeddings.py's
(unchanged, run through front workers); here, on the real service, that one process (its own
loop) and front workers (forwarded, awaited) give the same bytes. ``GET /v1/models/{name}`` of a
plain name (TF Serving's model status, OpenAI's ``models.retrieve`` for an OpenAI client) is on
that path too: before, it fell to the serving process's threaded app."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import requests

from appliance.api.family import AsyncFamily
from appliance.core.config import Config
from appliance.fronts.app import FrontApp, ForwardedStreams, hot_mounts
from appliance.fronts.link import Link
from appliance.fronts.remote import RemoteCore
from tests.api.test_openai_embeddings import TEXTS, encoders  # noqa: F401  (the module fixture)

PATHS = [("POST", "/v1/embeddings"), ("GET", "/v1/models"), ("HEAD", "/v1/models"), ("GET", "/v1/models/chat:1"),
         ("GET", "/v1/models/chat"), ("HEAD", "/v1/models/chat")]  # a plain name: TF Serving's model status
APP_PATHS = [("GET", "/v1/models/chat/metadata"), ("GET", "/v1/models/chat/versions/1")]  # still the app's


def _environ(method: str, path: str) -> dict[str, Any]:
    return {"REQUEST_METHOD": method, "PATH_INFO": path, "REQUEST_URI": path, "CONTENT_LENGTH": "0",
            "wsgi.input": io.BytesIO(b""), "wsgi.url_scheme": "http"}


def _fallback(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    raise AssertionError(f"{environ['PATH_INFO']} went to the WSGI fallback (a thread)")


@pytest.mark.parametrize("method,path", PATHS)
def test_a_front_worker_forwards_them_on_its_loop(method: str, path: str) -> None:
    """In a worker, the path's handler is ``ForwardedStreams``: awaited on the loop (before:
    the WSGI ``Forwarder``, one worker thread held per request, another in the serving process)."""
    remote = RemoteCore(Config(), Link(lambda message: None))
    app = FrontApp(remote, hot_mounts(remote), _fallback)
    assert app.route(_environ(method, path)) is not None
    mount = app.hot.match(method, path)
    assert mount is not None and isinstance(mount.handler, ForwardedStreams)
    for other in APP_PATHS:
        assert app.route(_environ(*other)) is None, other  # forwarded to the serving process's app, as before


def test_the_serving_process_answers_them_with_its_async_family() -> None:
    """In the serving process the token mounts hold ``OpenAIAPI`` for every OpenAI path: the
    forwarded request is answered on the loop (appliance/fronts/serving.py asks ``route`` first)."""
    from appliance.api.families import token_mounts
    from appliance.api.openai import OpenAIAPI

    api = OpenAIAPI(core=None)  # type: ignore[arg-type]  # only the mounts are read
    mounts = {m.name: m for m in token_mounts(api, api)}
    for name in ("openai-embeddings", "openai-models"):
        assert mounts[name].handler is api and isinstance(api, AsyncFamily)
    for method, path in PATHS:
        assert any(m.matches(method, path) and m.handler is api for m in mounts.values()), (method, path)
    assert not any(m.matches(*other) for other in APP_PATHS for m in mounts.values())


def test_one_process_and_front_workers_answer_the_same_bytes(start_server: Any, encoders: Path) -> None:  # noqa: F811
    """``/v1/embeddings`` (float and base64), ``/v1/models`` (its ids: ``created`` is each
    service's load time), a model id, and a plain name (TF Serving's model status) through the
    serving process's loop (``--workers 1``) and through front workers: the same answers."""
    answers: list[list[Any]] = []
    for workers in ("1", "2"):
        srv = start_server("--models", str(encoders), "--workers", workers)
        got: list[Any] = []
        for fmt in ("float", "base64"):
            r = requests.post(f"{srv.url}/v1/embeddings", timeout=60,
                              json={"model": "enc", "input": TEXTS, "encoding_format": fmt})
            got.append((r.status_code, r.headers["Content-Type"], r.content))
        listed = requests.get(f"{srv.url}/v1/models", timeout=60)
        got.append((listed.status_code, sorted(m["id"] for m in listed.json()["data"])))
        head = requests.head(f"{srv.url}/v1/models", timeout=60)
        got.append((head.status_code, head.content, head.headers["Content-Length"] == listed.headers["Content-Length"]))
        for path in ("/v1/models/enc:1", "/v1/models/enc", "/v1/models/nothing:1"):
            r = requests.get(f"{srv.url}{path}", timeout=60, headers={"X-Stainless-Lang": "python"} if ":" in path else {})
            body = r.json()
            body.pop("created", None)
            got.append((path, r.status_code, body))
        wrong = requests.get(f"{srv.url}/v1/embeddings", timeout=60)
        got.append((wrong.status_code, wrong.content))
        got.append(_plain_names(srv.url))
        answers.append(got)
        srv.stop()
    assert answers[0] == answers[1]
    by_path = {g[0]: g for g in answers[0] if isinstance(g, tuple) and isinstance(g[0], str)}
    assert answers[0][0][0] == 200 and len(answers[0][0][2]) > 100
    assert answers[0][2] == (200, ["enc", "enc:1", "enc_lite", "enc_lite:1"]), answers[0][2]
    assert answers[0][3] == (200, b"", True)
    assert by_path["/v1/models/enc:1"][1] == 200 and by_path["/v1/models/enc:1"][2]["id"] == "enc:1"
    assert "model_version_status" in by_path["/v1/models/enc"][2]  # TF Serving's, for its clients
    assert by_path["/v1/models/nothing:1"][1] == 404
    assert answers[0][-2][0] == 405
    plain = answers[0][-1]
    assert plain["status"][:2] == (200, "application/json") and b"model_version_status" in plain["status"][3]
    assert plain["status"] == plain["tf_serving_own"]  # the bytes TF Serving's own handler writes (the app's)
    assert plain["head"] == (400, plain["head"][1], b"")  # TF Serving answers GET only, as before
    assert plain["missing"][0] == 404 and b"Could not find any versions of model nothing" in plain["missing"][3]
    assert plain["retrieve"] == {"id": "enc", "object": "model", "owned_by": "edge-appliance"}, plain["retrieve"]
    assert plain["retrieve_missing"][0] == 404 and "does not exist" in plain["retrieve_missing"][1]


def _plain_names(url: str) -> dict[str, Any]:
    """``GET /v1/models/{name}`` of a plain name: TF Serving's status (whole answer: status,
    type, length, bytes; and the same of ``/versions/1``, which TF Serving's own mount answers
    in the app, for the only version), HEAD, an unknown name, and OpenAI's ``models.retrieve``
    (the official client when installed: it sends ``X-Stainless-Lang``)."""
    def whole(r: requests.Response) -> tuple[int, str, str, bytes]:
        return r.status_code, r.headers.get("Content-Type", ""), r.headers.get("Content-Length", ""), r.content

    out: dict[str, Any] = {
        "status": whole(requests.get(f"{url}/v1/models/enc", timeout=60)),
        "tf_serving_own": whole(requests.get(f"{url}/v1/models/enc/versions/1", timeout=60)),
        "head": (lambda r: (r.status_code, r.headers.get("Content-Length"), r.content))(
            requests.head(f"{url}/v1/models/enc", timeout=60)),
        "missing": whole(requests.get(f"{url}/v1/models/nothing", timeout=60)),
    }
    try:
        import openai
    except ImportError:
        retrieve = requests.get(f"{url}/v1/models/enc", timeout=60, headers={"X-Stainless-Lang": "python"}).json()
        gone = requests.get(f"{url}/v1/models/nothing", timeout=60, headers={"X-Stainless-Lang": "python"})
        out["retrieve_missing"] = (gone.status_code, gone.json()["error"]["message"])
    else:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        retrieve = client.models.retrieve("enc").model_dump()
        try:
            client.models.retrieve("nothing")
            out["retrieve_missing"] = (200, "")
        except openai.NotFoundError as exc:
            out["retrieve_missing"] = (exc.status_code, str(exc))
        finally:
            client.close()
    retrieve.pop("created", None)
    out["retrieve"] = retrieve
    return out

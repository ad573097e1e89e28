"""Rows and values counted on a JSON body's bytes before it is parsed (appliance/api/json_rows.py):
exact against a parser's count on bodies built to trip a byte scanner (brackets, commas and
escaped quotes in strings, keys written with escapes, nested and duplicate keys), with the
chunks made small so that every escape, string and array straddles a chunk's edge; a row bomb
stops early; a real 16 KB gzip bomb is refused by the real service with a 400 naming the limit,
a 20 MB string where numbers belong with a short 400 (appliance/core/errors.py cuts a message),
and the front worker that refused them answers on, never replaced.
"""

from __future__ import annotations

import gzip
import json
import random
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import requests

from appliance.api import json_rows

ROWS = ("instances", "examples")
BOMB_ROWS = 4_194_301  # the round-3 bomb: just under limits.max_tensor_elements with its envelope


def parsed_rows(body: bytes, key: str) -> int:
    doc = json.loads(body)
    return len(doc[key]) if isinstance(doc, dict) and isinstance(doc.get(key), list) else 0


def parsed_values(value: Any) -> int:
    if isinstance(value, dict):
        return sum(parsed_values(v) for v in value.values())
    if isinstance(value, list):
        return sum(parsed_values(v) for v in value)
    return 1


TRICKY = ['a,b', '[', ']', '{}', '"', '\\', '\\"', 'x\\\\', '],[', 'instances', '"instances":[1,2]', ', ,', '']


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(7 if depth < 3 else 3)
    if kind == 0:
        return rng.choice(TRICKY)
    if kind == 1:
        return rng.uniform(-5, 5)
    if kind == 2:
        return rng.choice([True, None, 7])
    if kind in (3, 4):
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(TRICKY + ["instances", "examples"]): random_value(rng, depth + 1) for _ in range(rng.randrange(3))}


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(json_rows, "CHUNK", 7)  # every escape, string and array crosses chunk edges
    yield


@pytest.mark.parametrize("seed", range(40))
def test_counts_match_a_parser(seed: int, small_chunks: None) -> None:
    rng = random.Random(seed)
    doc: dict[str, Any] = {rng.choice(TRICKY): random_value(rng) for _ in range(rng.randrange(3))}
    rows = [random_value(rng) for _ in range(rng.randrange(12))]
    doc["instances"] = rows
    body = json.dumps(doc, indent=rng.choice([None, 1])).encode()
    if seed % 3 == 0:  # the key written with an escape, as a parser reads it
        body = body.replace(b'"instances": [', b'"instanc\\u0065s": [', 1)
    assert json_rows.count_values(body) == parsed_values(doc), body
    expected = parsed_rows(body, "instances")
    for limit in (0, 1, expected - 1, expected):
        over = json_rows.rows_over(body, ROWS, max(0, limit))
        if expected > max(0, limit):
            assert over is not None and over[0] == "instances" and over[1] > max(0, limit), (body, limit, over)
        else:
            assert over is None, (body, limit, over)


def test_only_the_root_objects_key_counts(small_chunks: None) -> None:
    nested = json.dumps({"inputs": {"instances": [1] * 50}, "note": '"instances": [' + "1," * 50}).encode()
    assert json_rows.rows_over(nested, ROWS, 3) is None
    assert json_rows.rows_over(b'{"examples": [], "instances": [[1, 2], [3]]}', ROWS, 1)[0] == "instances"
    duplicate = b'{"instances": [1], "instances": [1, 2, 3, 4, 5, 6, 7, 8]}'  # a parser keeps the last
    assert json_rows.rows_over(duplicate, ROWS, 4)[0] == "instances"  # counted until past 4
    assert json_rows.rows_over(duplicate, ROWS, 8) is None
    assert json_rows.rows_over(b'{"instances": 5, "pad": "' + b"x" * 40 + b'"}', ROWS, 1) is None


def test_a_row_bomb_is_counted_only_past_its_limit() -> None:
    body = b'{"instances": [' + b",".join([b'"a"'] * BOMB_ROWS) + b"]}"
    key, counted = json_rows.rows_over(body, ROWS, 4096) or ("", 0)
    assert key == "instances" and 4096 < counted < BOMB_ROWS  # it stopped: the first chunk told


@pytest.mark.parametrize("path", ["simdjson's tape", "the bytes (an escape)", "the bytes (long)"])
def test_the_decoder_refuses_rows_before_parsing_on_every_path(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.api.tfserving import json_format
    from appliance.core.config import LimitsConfig
    from appliance.core.errors import InvalidArgument

    doc = {"signature_name": "a\\b" if "escape" in path else "ab", "instances": [[0.125] * 64] * 5}
    body = json.dumps(doc).encode()
    assert len(body) > 2048  # past json_arrays.MIN_BODY: simdjson would take it
    if "long" in path:
        monkeypatch.setattr(json_format, "SCAN_FIRST", 1024)
    def parse(_: bytes) -> None:
        raise AssertionError("parsed before the refusal")

    monkeypatch.setattr(json_format, "orjson", SimpleNamespace(loads=parse, JSONDecodeError=ValueError))
    with pytest.raises(InvalidArgument, match=r"'instances' has more than 3 entries .*limits.max_instances"):
        json_format.loads(body, LimitsConfig(max_instances=3))


# --- the real service, with two front workers -----------------------------------------------------
def test_the_16_kb_gzip_bomb_gets_a_400_and_the_worker_answers_on(start_server: Any, models_dir: Path,
                                                                  tmp_path: Path) -> None:
    from tests.fronts.test_fronts import MLP, ROW, models

    body = gzip.compress(b'{"instances": [' + b",".join([b'"a"'] * BOMB_ROWS) + b"]}", 9)
    assert len(body) < 20_000
    server = start_server("--models", str(models(models_dir, tmp_path, MLP)),
                          "--backend", "tflite", "--workers", "2")
    url = f"{server.url}/v1/models/{MLP}:predict"
    with requests.Session() as session:  # one connection: the same worker refuses, then answers
        for _ in range(3):
            resp = session.post(url, data=body, headers={"Content-Encoding": "gzip"}, timeout=60)
            assert resp.status_code == 400, resp.text[:300]
            error = resp.json()["error"]
            assert "limits.max_instances" in error and "'instances' has more than 4096 entries" in error
            assert len(resp.content) < 1024  # the limit named, nothing of the body echoed
            assert session.post(url, json={"instances": [ROW]}, timeout=30).status_code == 200
        long_string = b'{"instances": [["' + b"a" * 20_000_000 + b'"]]}'  # a string where numbers belong
        resp = session.post(url, data=long_string, timeout=60)
        assert resp.status_code == 400 and len(resp.content) < 4096, resp.content[:300]
        assert session.post(url, json={"instances": [ROW]}, timeout=30).status_code == 200
    workers = server.status()["workers"]
    assert all(w["restarts"] == 0 for w in workers), workers

"""``POST /v1/embeddings`` (appliance/api/openai_embeddings.py), judged by the official ``openai``
client's ``embeddings.create`` against the real ``appliance serve`` (front workers by default).

Models built here with TensorFlow: an encoder whose ``embed`` signature takes ``input_ids`` and
``attention_mask`` [batch, n] and returns ``embeddings`` [batch, 8] (a masked mean of token
embeddings through a dense layer, L2-normalised), with a character vocabulary
(``assets/vocab.json``: token i is ``chr(i)``): ``enc`` as a SavedModel of any n (tf-cpu),
``enc_lite`` as a TFLite model of n = 16 (LiteRT). The expected vectors are the signature's own
output, run here on the same inputs (TensorFlow, LiteRT's signature runner), and numpy's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the official OpenAI client (the test extra)")

VOCAB = [chr(i) for i in range(128)]
DIM, FIXED = 8, 16
TEXTS = ["hello", "longer, less pad", "x"]


def _weights() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(35)
    return rng.normal(0, 1, (len(VOCAB), DIM)).astype(np.float32), rng.normal(0, 1, (DIM, DIM)).astype(np.float32)


def _encoder(tf: Any, width: int | None) -> Any:
    table, dense = (tf.constant(w) for w in _weights())
    spec = [tf.TensorSpec([None, width], tf.int32, name="input_ids"),
            tf.TensorSpec([None, width], tf.int32, name="attention_mask")]

    @tf.function(input_signature=spec)
    def embed(input_ids: Any, attention_mask: Any) -> dict[str, Any]:
        mask = tf.cast(attention_mask, tf.float32)[:, :, None]
        pooled = tf.reduce_sum(tf.gather(table, input_ids) * mask, 1) / tf.reduce_sum(mask, 1)
        return {"embeddings": tf.math.l2_normalize(tf.matmul(pooled, dense), axis=1)}

    module = tf.Module()
    module.embed = embed
    return module


def _version(root: Path) -> Path:
    (root / "assets").mkdir(parents=True)
    (root / "assets" / "vocab.json").write_text(json.dumps(VOCAB))
    return root


@pytest.fixture(scope="module")
def encoders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import tensorflow as tf

    base = tmp_path_factory.mktemp("embeddings") / "models"
    sm = _version(base / "enc" / "1")
    module = _encoder(tf, None)
    tf.saved_model.save(module, str(sm), signatures={"embed": module.embed})
    fixed = _encoder(tf, FIXED)
    staging = tmp_path_factory.mktemp("enc-fixed")
    tf.saved_model.save(fixed, str(staging), signatures={"embed": fixed.embed})
    lite = _version(base / "enc_lite" / "1")
    (lite / "model.tflite").write_bytes(tf.lite.TFLiteConverter.from_saved_model(
        str(staging), signature_keys=["embed"]).convert())
    return base


@pytest.fixture(scope="module")
def client(module_server: Any, encoders: Path) -> Any:
    server = module_server("--models", str(encoders))
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


def _feeds(texts: list[str], width: int | None) -> dict[str, np.ndarray]:
    """The signature's inputs as the documented convention makes them: right-padded with 0."""
    n = width or max(len(t) for t in texts)
    ids, mask = np.zeros((len(texts), n), np.int32), np.zeros((len(texts), n), np.int32)
    for i, t in enumerate(texts):
        ids[i, :len(t)], mask[i, :len(t)] = [ord(c) for c in t], 1
    return {"input_ids": ids, "attention_mask": mask}


def _numpy(texts: list[str]) -> np.ndarray:
    table, dense = _weights()
    pooled = np.stack([table[[ord(c) for c in t]].mean(0) for t in texts]) @ dense
    return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)  # type: ignore[no-any-return]


def _signature_output(encoders: Path, model: str, texts: list[str]) -> np.ndarray:
    if model == "enc_lite":
        from ai_edge_litert.interpreter import Interpreter

        runner = Interpreter(str(encoders / model / "1" / "model.tflite")).get_signature_runner("embed")
        return np.concatenate([runner(**{k: v[i:i + 1] for k, v in _feeds(texts, FIXED).items()})["embeddings"]
                               for i in range(len(texts))])
    import tensorflow as tf

    embed = tf.saved_model.load(str(encoders / model / "1")).signatures["embed"]
    return embed(**{k: tf.constant(v) for k, v in _feeds(texts, None).items()})["embeddings"].numpy()  # type: ignore[no-any-return]


@pytest.mark.parametrize("model", ["enc", "enc_lite"])
def test_embeddings_are_the_signatures_output(client: Any, encoders: Path, model: str) -> None:
    expected = _signature_output(encoders, model, TEXTS)
    np.testing.assert_allclose(expected, _numpy(TEXTS), rtol=1e-4, atol=1e-5)  # the model is what we think
    for fmt in ("float", None):  # None: the client asks for base64 and decodes it itself
        kw = {"encoding_format": fmt} if fmt else {}
        answer = client.embeddings.create(model=model, input=TEXTS, **kw)
        got = np.array([d.embedding for d in sorted(answer.data, key=lambda d: d.index)], np.float32)
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
        assert answer.model == f"{model}:1" and answer.object == "list"
        assert answer.usage.prompt_tokens == sum(len(t) for t in TEXTS) == answer.usage.total_tokens
    one = client.embeddings.create(model=model, input="hello")  # a single string
    np.testing.assert_allclose(np.array(one.data[0].embedding, np.float32), expected[0], rtol=1e-6, atol=1e-6)
    ids = client.embeddings.create(model=model, input=[[ord(c) for c in "hello"]])  # token ids as they are
    np.testing.assert_allclose(np.array(ids.data[0].embedding, np.float32), expected[0], rtol=1e-6, atol=1e-6)


def test_embedding_errors_name_the_field(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as dims:
        client.embeddings.create(model="enc", input="hi", dimensions=4)
    assert dims.value.param == "dimensions" and f"have {DIM}" in dims.value.message
    with pytest.raises(openai.BadRequestError) as long:
        client.embeddings.create(model="enc_lite", input="y" * (FIXED + 1))
    assert long.value.param == "input" and f"at most {FIXED}" in long.value.message
    with pytest.raises(openai.BadRequestError) as foreign:
        client.embeddings.create(model="enc", input="naïve")  # outside the vocabulary
    assert foreign.value.param == "input" and "'ï'" in foreign.value.message
    with pytest.raises(openai.NotFoundError) as unknown:
        client.embeddings.create(model="nope", input="hi")
    assert unknown.value.code == "model_not_found"


def test_the_model_list_names_the_encoders_embeddings_serves(client: Any) -> None:
    """GET /v1/models listed only the models that generate: an app looking up its embedding model
    found none (issue 45)."""
    ids = {m.id for m in client.models.list().data}
    assert {"enc", "enc:1", "enc_lite", "enc_lite:1"} <= ids

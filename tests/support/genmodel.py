"""A tiny real generative model for the generation tests and bench, exported both ways.

``train()`` fits a character-level transformer (Keras, 2 layers, d=32) on
``tests/data/gen_corpus.txt`` in a few seconds. The same forward pass (``forward``,
TensorFlow ops, an explicit KV cache indexed by position) is then exported as:

* ``build_tflite(dir)``: the LiteRT LLM convention of ai-edge-torch's generative
  converter: a ``prefill`` signature (``tokens`` [1, 16], ``input_pos`` [16] and the
  external cache ``kv_cache_k_i``/``kv_cache_v_i`` [1, 64, 2, 16]) and a ``decode``
  signature with a fixed batch of 4 (``tokens`` [4, 1], ``input_pos`` [4], cache
  [4, 64, 2, 16]); outputs ``logits`` (decode only) and the updated cache, same names.
  Options give ai-edge-torch's other shapes: ``gen_tflite_aet`` is its default export
  (decode batch 1, ``input_pos`` [1], the ``mask`` as an input, ``prefill_4`` and
  ``prefill_8``), ``gen_tflite_shared`` a decode batch of 4 sharing one ``input_pos`` [1];
* ``build_savedmodel(dir)``: a ``tf.Module`` whose ``generate_step`` is a ``tf.function``
  with an input signature: ``input_ids`` [batch, n], ``input_pos`` [batch] and one
  ``cache`` tensor [batch, 4, 64, 2, 16] in; ``logits`` [batch, vocab] (next token) and
  ``cache`` out.

Both ship ``assets/vocab.json`` (the characters, index = token id). ``build_slow`` makes an
untrained ``generate_step`` model that spends ~80 ms a step (the hot-swap test needs a
stream that is still running while a new version loads). ``greedy_tflite`` and
``greedy_savedmodel`` are the in-process reference loops the tests compare the server to:
they never use the server's prefill path (every prompt token goes through ``decode``, or
the whole history is recomputed each step).

``build(out)`` builds everything into ``out/<name>/<version>``; ``models_dir`` in
``tests/api/test_generate.py`` caches it under /tmp keyed by this file's hash.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

CORPUS = Path(__file__).resolve().parents[1] / "data" / "gen_corpus.txt"
D, HEADS, HEAD_DIM, LAYERS, FFN = 32, 2, 16, 2, 64
CONTEXT = 64  # KV cache length: prompt + generated tokens
PREFILL_LEN = 16
DECODE_BATCH = 4
SEQ, STEPS = 32, 400  # training windows and optimizer steps
PROMPTS = ("the model ", "a new stream ", "red sky at ", "one, two, ")


_TF: Any = None


def _tf() -> Any:
    global _TF
    if _TF is None:  # imported once; later calls (inside traced functions) touch nothing
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import tensorflow as tf

        _TF = tf
    return _TF


def vocab() -> list[str]:
    return sorted(set(CORPUS.read_text()))


def encode(text: str) -> list[int]:
    table = {c: i for i, c in enumerate(vocab())}
    return [table[c] for c in text]


# --------------------------------------------------------------------------
# the forward pass, shared by training and both exports
# --------------------------------------------------------------------------
def _layer_norm(tf: Any, x: Any, gamma: Any, beta: Any) -> Any:
    mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(var + 1e-5) * gamma + beta


def forward(w: dict[str, Any], tokens: Any, pos: Any, cache: list[tuple[Any, Any]] | None,
            mask: Any = None) -> tuple[Any, list]:
    """Logits [B, T, V] of ``tokens`` [B, T] at positions ``pos`` [B, T]. With ``cache``
    (per layer (k, v), each [B, CONTEXT, HEADS, HEAD_DIM]) the new keys/values are written
    at their positions and attention reads the cache; without it, causal self-attention.
    ``mask`` ([B, 1, T, CONTEXT], additive) replaces the causal mask made from ``pos``."""
    tf = _tf()
    b, t = tf.shape(tokens)[0], tf.shape(tokens)[1]
    h = tf.gather(w["tok"], tokens) + tf.gather(w["pos"], pos)
    new_cache = []
    for i in range(LAYERS):
        a = _layer_norm(tf, h, w[f"ln1g{i}"], w[f"ln1b{i}"])
        q, k, v = (tf.reshape(tf.matmul(a, w[f"w{n}{i}"]), [b, t, HEADS, HEAD_DIM]) for n in "qkv")
        if cache is None:
            kc, vc, key_pos = k, v, pos
        else:
            onehot = tf.one_hot(pos, CONTEXT, dtype=tf.float32)  # [B, T, L]
            keep = 1.0 - tf.reduce_max(onehot, axis=1)[:, :, None, None]
            kc = cache[i][0] * keep + tf.einsum("btl,bthd->blhd", onehot, k)
            vc = cache[i][1] * keep + tf.einsum("btl,bthd->blhd", onehot, v)
            key_pos = tf.broadcast_to(tf.range(CONTEXT)[None, :], [b, CONTEXT])
            new_cache.append((kc, vc))
        scores = tf.einsum("bthd,blhd->bhtl", q, kc) * (HEAD_DIM ** -0.5)
        if mask is None:
            allowed = tf.cast(key_pos[:, None, None, :] <= pos[:, None, :, None], tf.float32)
            scores = scores + (1.0 - allowed) * -1e9
        else:
            scores = scores + mask
        probs = tf.nn.softmax(scores, axis=-1)
        o = tf.reshape(tf.einsum("bhtl,blhd->bthd", probs, vc), [b, t, D])
        h = h + tf.matmul(o, w[f"wo{i}"])
        f = _layer_norm(tf, h, w[f"ln2g{i}"], w[f"ln2b{i}"])
        h = h + tf.matmul(tf.nn.relu(tf.matmul(f, w[f"f1{i}"]) + w[f"f1b{i}"]), w[f"f2{i}"]) + w[f"f2b{i}"]
    h = _layer_norm(tf, h, w["lnfg"], w["lnfb"])
    return tf.matmul(h, w["out"]) + w["outb"], new_cache


def _shapes(v: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"tok": (v, D), "pos": (CONTEXT, D), "lnfg": (D,), "lnfb": (D,),
                                          "out": (D, v), "outb": (v,)}
    for i in range(LAYERS):
        shapes.update({f"ln1g{i}": (D,), f"ln1b{i}": (D,), f"ln2g{i}": (D,), f"ln2b{i}": (D,),
                       f"wq{i}": (D, D), f"wk{i}": (D, D), f"wv{i}": (D, D), f"wo{i}": (D, D),
                       f"f1{i}": (D, FFN), f"f1b{i}": (FFN,), f"f2{i}": (FFN, D), f"f2b{i}": (D,)})
    return shapes


def train(seed: int = 0, steps: int = STEPS) -> dict[str, np.ndarray]:
    """Fit the transformer (a Keras model) on the corpus; its weights as numpy arrays."""
    tf = _tf()
    import keras

    keras.utils.set_random_seed(seed)
    v = len(vocab())

    class CharTransformer(keras.Model):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.w = {}
            for name, shape in _shapes(v).items():
                init = "ones" if name.startswith("ln") and name[3] == "g" else (
                    "zeros" if name.endswith("b") or name.startswith("ln") else
                    keras.initializers.RandomNormal(stddev=0.08))
                self.w[name] = self.add_weight(name=name, shape=shape, initializer=init)

        def call(self, tokens: Any) -> Any:
            pos = tf.broadcast_to(tf.range(tf.shape(tokens)[1])[None, :], tf.shape(tokens))
            return forward(self.w, tokens, pos, None)[0]

    ids = np.array(encode(CORPUS.read_text()), dtype=np.int32)
    starts = np.arange(0, len(ids) - SEQ - 1)
    x = np.stack([ids[s:s + SEQ] for s in starts])
    y = np.stack([ids[s + 1:s + SEQ + 1] for s in starts])
    model = CharTransformer()
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    reps = max(1, steps * 32 // len(x))
    model.fit(np.tile(x, (reps, 1)), np.tile(y, (reps, 1)), batch_size=32, epochs=1, verbose=0, shuffle=True)
    return {name: np.asarray(var.numpy()) for name, var in model.w.items()}


# --------------------------------------------------------------------------
# exports
# --------------------------------------------------------------------------
def _kv_names() -> list[str]:
    return [f"kv_cache_{kind}_{i}" for i in range(LAYERS) for kind in "kv"]


def _write_assets(version_dir: Path) -> None:
    (version_dir / "assets").mkdir(parents=True, exist_ok=True)
    (version_dir / "assets" / "vocab.json").write_text(json.dumps(vocab()))


def build_tflite(version_dir: Path, weights: dict[str, np.ndarray], decode_batch: int = DECODE_BATCH,
                 shared_position: bool = False, mask: bool = False, prefill_lens: tuple[int, ...] = (PREFILL_LEN,)
                 ) -> Path:
    """A prefill/decode LiteRT model (module docstring), with warm-up requests. The options
    give ai-edge-torch's other export shapes: ``input_pos`` [1] shared by the decode batch,
    the attention ``mask`` as an input, several ``prefill_<N>`` signatures."""
    tf = _tf()
    w = {k: tf.constant(a) for k, a in weights.items()}
    kv = lambda batch: [tf.TensorSpec([batch, CONTEXT, HEADS, HEAD_DIM], tf.float32, name=n) for n in _kv_names()]
    mask_spec = lambda batch, t: [tf.TensorSpec([batch, 1, t, CONTEXT], tf.float32, name="mask")] * mask

    def step(args: tuple[Any, ...], pos: Any, with_logits: bool) -> dict[str, Any]:
        flat = args[2:2 + 2 * LAYERS]
        pairs = [(flat[2 * i], flat[2 * i + 1]) for i in range(LAYERS)]
        logits, new = forward(w, args[0], pos, pairs, args[-1] if mask else None)
        out = {name: t for name, t in zip(_kv_names(), [t for pair in new for t in pair])}
        if with_logits:
            out["logits"] = logits
        return out

    signatures = {}
    for n in prefill_lens:  # the signature's input names are the TensorSpec names
        @tf.function(autograph=False, input_signature=[tf.TensorSpec([1, n], tf.int32, name="tokens"),
                                      tf.TensorSpec([n], tf.int32, name="input_pos"), *kv(1), *mask_spec(1, n)])
        def prefill(*args: Any) -> dict[str, Any]:
            return step(args, args[1][None, :], False)

        signatures["prefill" if len(prefill_lens) == 1 else f"prefill_{n}"] = prefill.get_concrete_function()

    @tf.function(autograph=False, input_signature=[tf.TensorSpec([decode_batch, 1], tf.int32, name="tokens"),
                                  tf.TensorSpec([1 if shared_position else decode_batch], tf.int32, name="input_pos"),
                                  *kv(decode_batch), *mask_spec(decode_batch, 1)])
    def decode(*args: Any) -> dict[str, Any]:
        pos = tf.broadcast_to(args[1][:, None], [decode_batch, 1])
        return step(args, pos, True)

    signatures["decode"] = decode.get_concrete_function()
    module = tf.Module()
    with tempfile.TemporaryDirectory() as tmp:
        tf.saved_model.save(module, tmp, signatures=signatures)
        converter = tf.lite.TFLiteConverter.from_saved_model(tmp, signature_keys=list(signatures))
        flat = converter.convert()
    version_dir.mkdir(parents=True, exist_ok=True)
    (version_dir / "model.tflite").write_bytes(flat)
    _write_assets(version_dir)
    _write_warmup(version_dir)
    return version_dir


def _write_warmup(version_dir: Path) -> None:
    """One zero request per signature at its declared shapes: the server's synthetic warm-up
    would resize ``input_pos`` [N] to [1], which a fixed-shape prefill cannot run."""
    from ai_edge_litert.interpreter import Interpreter

    from tests.support import modelgen

    interp = Interpreter(model_path=str(version_dir / "model.tflite"))
    records = []
    for name in interp.get_signature_list():
        details = interp.get_signature_runner(name).get_input_details()
        inputs = {k: np.zeros(d["shape"], d["dtype"]) for k, d in details.items()}
        records.append(modelgen.encode_predict_log("gen", inputs, name))
    modelgen.write_warmup_file(version_dir, records)


def _generate_step_module(tf: Any, w: dict[str, Any], extra: Any = None) -> Any:
    cache_spec = tf.TensorSpec([None, 2 * LAYERS, CONTEXT, HEADS, HEAD_DIM], tf.float32, name="cache")

    class GenerateStep(tf.Module):  # type: ignore[misc]
        @tf.function(autograph=False, input_signature=[tf.TensorSpec([None, None], tf.int32, name="input_ids"),
                                      tf.TensorSpec([None], tf.int32, name="input_pos"), cache_spec])
        def generate_step(self, input_ids, input_pos, cache):  # type: ignore[no-untyped-def]
            n = tf.shape(input_ids)[1]
            pos = input_pos[:, None] + tf.range(n)[None, :]
            pairs = [(cache[:, 2 * i], cache[:, 2 * i + 1]) for i in range(LAYERS)]
            logits, new = forward(w, input_ids, pos, pairs)
            last = logits[:, -1, :]
            if extra is not None:  # the slow model: busy work that depends on the input
                last = last + extra(tf.cast(tf.reduce_sum(input_ids), tf.float32))
            return {"logits": last, "cache": tf.stack([t for pair in new for t in pair], axis=1)}

    return GenerateStep()


def build_savedmodel(version_dir: Path, weights: dict[str, np.ndarray], extra: Any = None) -> Path:
    tf = _tf()
    module = _generate_step_module(tf, {k: tf.constant(a) for k, a in weights.items()}, extra)
    if version_dir.exists():
        shutil.rmtree(version_dir)
    tf.saved_model.save(module, str(version_dir),
                        signatures={"generate_step": module.generate_step.get_concrete_function()})
    _write_assets(version_dir)
    return version_dir


def build_slow(version_dir: Path, seed: int) -> Path:
    """Untrained weights (``seed``) plus ~80 ms of matrix products per step (a 60-token stream
    runs ~5 s: time for a new version to load while it runs)."""
    tf = _tf()
    rng = np.random.default_rng(seed)
    weights = {n: rng.normal(0, 0.3, s).astype(np.float32) for n, s in _shapes(len(vocab())).items()}
    heavy = tf.constant(rng.normal(0, 0.01, (384, 384)).astype(np.float32))

    def extra(x: Any) -> Any:
        m = heavy + x * 1e-9
        for _ in range(20):
            m = tf.tanh(tf.matmul(m, heavy))
        return tf.reduce_sum(m) * 0.0

    return build_savedmodel(version_dir, weights, extra)


def build(out: Path) -> None:
    """Every generation test model under ``out/<name>/<version>``."""
    weights = train()
    build_tflite(out / "gen_tflite" / "1", weights)
    # ai-edge-torch's default export: decode batch 1, one shared input_pos, the mask as an
    # input, several prefill lengths; and a batch of 4 sharing one position.
    build_tflite(out / "gen_tflite_aet" / "1", weights, decode_batch=1, shared_position=True, mask=True,
                 prefill_lens=(4, 8))
    build_tflite(out / "gen_tflite_shared" / "1", weights, shared_position=True)
    build_savedmodel(out / "gen_savedmodel" / "1", weights)
    build_slow(out / "gen_slow" / "1", seed=1)
    build_slow(out / "gen_slow_v2" / "2", seed=2)  # copied in as version 2 by the hot-swap test


# --------------------------------------------------------------------------
# in-process reference loops (greedy), batch 1, without the server's prefill path
# --------------------------------------------------------------------------
def greedy_tflite(path: Path, prompt: list[int], n: int) -> list[int]:
    """Every prompt token through ``decode`` (row 0 of its batch), then n greedy steps."""
    from ai_edge_litert.interpreter import Interpreter

    decode = Interpreter(model_path=str(path / "model.tflite")).get_signature_runner("decode")
    details = decode.get_input_details()
    batch, pos_rows = details["tokens"]["shape"][0], details["input_pos"]["shape"][0]
    cache = {name: np.zeros([batch, CONTEXT, HEADS, HEAD_DIM], np.float32) for name in _kv_names()}
    out, token = [], prompt[0]
    for pos in range(len(prompt) + n - 1):
        tokens = np.zeros([batch, 1], np.int32)
        tokens[0, 0] = token
        feeds = {"tokens": tokens, "input_pos": np.full([pos_rows], pos, np.int32), **cache}
        if "mask" in details:
            feeds["mask"] = np.where(np.arange(CONTEXT) <= pos, 0.0, -1e9).astype(np.float32) \
                .reshape(1, 1, 1, CONTEXT).repeat(batch, axis=0)
        result = decode(**feeds)
        cache = {name: np.array(result[name]) for name in _kv_names()}
        if pos + 1 < len(prompt):
            token = prompt[pos + 1]
        else:
            token = int(np.argmax(result["logits"][0, -1]))
            out.append(token)
    return out


def greedy_savedmodel(path: Path, prompt: list[int], n: int) -> list[int]:
    """The whole history recomputed each step from an empty cache (no cache reuse)."""
    tf = _tf()
    fn = tf.saved_model.load(str(path)).signatures["generate_step"]
    history, out = list(prompt), []
    for _ in range(n):
        result = fn(input_ids=tf.constant([history], tf.int32), input_pos=tf.constant([0], tf.int32),
                    cache=tf.zeros([1, 2 * LAYERS, CONTEXT, HEADS, HEAD_DIM]))
        token = int(np.argmax(result["logits"].numpy()[0]))
        out.append(token)
        history.append(token)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.support.genmodel OUT_DIR``: build every model into OUT_DIR (nowhere else)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tests.support.genmodel",
                                     description="Build the tiny generative test models (LiteRT and SavedModel "
                                                 "exports, module docstring) into OUT_DIR/<name>/<version>.")
    parser.add_argument("out_dir", type=Path, help="the folder to build into (made if missing)")
    target = parser.parse_args(argv).out_dir
    build(target)
    print(f"built into {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""TF Serving's API on numpy, shared by its REST (rest.py) and gRPC (grpc_service.py)
adapters: the handle on a version, classify/regress over serialized ``tf.Example``s and
the shape rules of their results. Protocol-neutral: no JSON, no protobuf here.
"""

from __future__ import annotations

import importlib.util

from typing import TYPE_CHECKING

import numpy as np

from runtimes import SignatureInfo

from appliance.core.errors import InvalidArgument, Unimplemented
from appliance.core.request_context import NO_CONTEXT, RequestContext
from appliance.core.seams import HandleSource, RouteKey
from appliance.protos.tfserving import wire as pw

if TYPE_CHECKING:
    import numpy.typing as npt

CLASSIFY_METHOD = "tensorflow/serving/classify"
REGRESS_METHOD = "tensorflow/serving/regress"


def data_type_string(dtype: npt.DTypeLike) -> str:
    """TensorFlow's DataTypeString, the name TF Serving's messages use: float32 -> "float",
    object (DT_STRING) -> "string", float16 -> "half"."""
    dtype = np.dtype(dtype)
    return str(pw.DTYPE_NAMES.get(pw.ENUM_OF.get(dtype, 0), "DT_" + dtype.name).removeprefix("DT_").lower())


async def run_examples(handles: HandleSource, serialized: np.ndarray, name: str, version: int | None,
                       label: str | None, signature_name: str, method: str,
                       route_key: RouteKey | None = None, context: RequestContext = NO_CONTEXT
                       ) -> tuple[int, SignatureInfo, dict[str, np.ndarray]]:
    """Run serialized tf.Examples through a classify or regress signature (REST and gRPC):
    (the version that answered, its signature, the outputs); ``context``: the request's."""
    with await handles.handle(name, version, label, route_key) as held:
        signature = held.signature(signature_name, f"No signature was found with the name: {signature_name}")
        if "inputs" not in signature.inputs or len(signature.inputs) != 1:
            kind = "classification" if method == "classify" else "regression"
            raise InvalidArgument(f"No {kind} inputs found in SignatureDef: {signature.name}")
        if not held.reads_examples:
            hint = ("pin runtime.backend = \"tf-cpu\" for this model" if importlib.util.find_spec("tensorflow")
                    else "install the TensorFlow extra: pip install 'edge-appliance[tf]'")
            raise Unimplemented(f":{method} feeds serialized tf.Example protos, which needs a TensorFlow backend, "
                                f"but {name} version {held.version} is served by {held.platform}; {hint}")
        outputs = await held.run(signature.name, {"inputs": serialized}, context)
        return held.version, signature, outputs


def regression_values(signature: SignatureInfo, outputs: dict[str, np.ndarray], n: int) -> np.ndarray:
    """A regress signature's ``outputs`` as one float32 value per example (REST and gRPC)."""
    if "outputs" not in outputs:
        raise InvalidArgument(f"No regression outputs found in SignatureDef: {signature.name}")
    values = outputs["outputs"]
    if values.ndim == 2 and values.shape[1] == 1:
        values = values[:, 0]
    if values.ndim != 1 or values.shape[0] != n:
        raise InvalidArgument("Expected output Tensor shape to be either [batch_size] or [batch_size, 1] "
                              f"but got {list(outputs['outputs'].shape)}")
    return values.astype(np.float32)


def classification_outputs(outputs: dict[str, np.ndarray], n: int) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray]:
    """(classes or None, scores or None, the one of them that gives the shape [n, k])."""
    classes, scores = outputs.get("classes"), outputs.get("scores")
    if classes is None and scores is None:
        raise InvalidArgument('Expected classification signature outputs to contain at least one of "classes" or "scores".')
    ref = scores if scores is not None else classes
    assert ref is not None  # one of them, checked above
    if ref.ndim != 2 or ref.shape[0] != n:
        raise InvalidArgument(f"Expected Tensor shape: [batch_size num_classes] but got {list(ref.shape)}")
    return classes, scores, ref

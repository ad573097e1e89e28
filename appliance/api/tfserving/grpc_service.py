"""TF Serving's gRPC API: ``tensorflow.serving.PredictionService`` and ``ModelService``.

``add_to_server(server, core)`` registers Predict, Classify, Regress, MultiInference and
GetModelMetadata, and GetModelStatus and HandleReloadConfigRequest, on the service's gRPC
port (``appliance.service.grpc_port``). ``tensorflow-serving-api``'s ``PredictionServiceStub``
and ``ModelServiceStub`` work unchanged. The work is the REST API's (appliance/api/tfserving/rest.py):
the same manager, version policy, labels and batchers, so a gRPC and a REST request in
flight together share a batch.

Tensors: inputs in either TensorProto encoding (typed ``*_val`` fields or
``tensor_content``, read by appliance/protos/tfserving/wire.py); outputs in the typed fields, as
TF Serving answers by default (``tf.make_ndarray`` reads both). ``output_filter`` picks
outputs. Status codes as TF Serving's: INVALID_ARGUMENT (bad input, unknown signature,
label or alias), NOT_FOUND (model or version), UNAVAILABLE (still loading),
RESOURCE_EXHAUSTED (the batch queue is full), UNIMPLEMENTED. Messages come from
appliance/protos/tfserving (a private descriptor pool): no TensorFlow at run time.
"""

from __future__ import annotations

import asyncio
import copy
from typing import TYPE_CHECKING, Awaitable, Callable, Iterable, Mapping

import grpc
import numpy as np
from google.protobuf.message import Message

from runtimes import DEFAULT_SIGNATURE, SignatureInfo

from appliance.protos.tfserving import wire as pw
from appliance.core.tfs_files import model_config_from_proto
from appliance.core.config import Config
from appliance.core.config import validate as validate_config
from appliance.core.errors import (ConfigError, FailedPrecondition, InvalidArgument, NotFound, QueueFull, Unavailable,
                                   Unimplemented)
from appliance.core.request_context import NO_CONTEXT, RequestContext
from appliance.core.seams import ModelStates, ServingCore
from appliance.api.grpc_errors import CallContext, guarded, guarded_run, observed
from appliance.api.tfserving.service import (CLASSIFY_METHOD, REGRESS_METHOD, classification_outputs,
                                             data_type_string, regression_values, run_examples)
from appliance.protos.tfserving import pb

if TYPE_CHECKING:
    from appliance.core.appliance import Appliance

TFS_CODES: dict[type, str] = {QueueFull: "RESOURCE_EXHAUSTED"}  # as the TF Serving clients expect for a full queue

PREDICTION_SERVICE = "tensorflow.serving.PredictionService"
MODEL_SERVICE = "tensorflow.serving.ModelService"
# numpy dtype -> the TensorProto field TF Serving fills for it (strings and halves: to_tensor)
_VAL_FIELD = {pw.DTYPES[enum]: field for enum, field in pw.VALUE_FIELD.items() if enum not in (7, 19)}


def add_to_server(server: grpc.Server, core: "Appliance") -> None:
    """Register both TF Serving services on ``server`` (before ``server.start()``)."""
    server.add_generic_rpc_handlers(TFServingGRPC(core, core.states, core.request_config).handlers())


class TFServingGRPC:
    """Every method is a coroutine, served on the gRPC server's event loop: inference awaits
    its batch there (appliance/core/seams.py); what may block (a config reload) runs on the
    loop's executor. ``states`` and ``reload`` are the serving process's (model status, the
    config reload): a front worker forwards those methods and has neither."""

    def __init__(self, core: ServingCore, states: ModelStates | None = None,
                 reload: Callable[[Config, str], None] | None = None):
        self.core, self.states, self.reload = core, states, reload

    def handlers(self) -> tuple[grpc.GenericRpcHandler, ...]:
        Method = Callable[[Message, CallContext], Awaitable[Message]]

        def table(methods: dict[str, tuple[type[Message], type[Message], Method]]) -> dict[str, grpc.RpcMethodHandler]:
            return {name: grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=req.FromString,
                response_serializer=resp.SerializeToString) for name, (req, resp, fn) in methods.items()}

        def runs(name: str, fn: Callable[[Message, RequestContext], Awaitable[Message]]) -> Method:
            return guarded_run(fn, name, TFS_CODES)  # it runs a model: the call's context goes with it

        def plain(name: str, fn: Callable[[Message], Awaitable[Message]]) -> Method:
            return guarded(fn, name, TFS_CODES)

        prediction = table({
            "Predict": (pb.PredictRequest, pb.PredictResponse, runs("Predict", self.predict)),
            "Classify": (pb.ClassificationRequest, pb.ClassificationResponse, runs("Classify", self.classify)),
            "Regress": (pb.RegressionRequest, pb.RegressionResponse, runs("Regress", self.regress)),
            "MultiInference": (pb.MultiInferenceRequest, pb.MultiInferenceResponse,
                               runs("MultiInference", self.multi_inference)),
            "GetModelMetadata": (pb.GetModelMetadataRequest, pb.GetModelMetadataResponse,
                                 plain("GetModelMetadata", self.metadata)),
        })
        model = table({
            "GetModelStatus": (pb.GetModelStatusRequest, pb.GetModelStatusResponse,
                               plain("GetModelStatus", self.model_status)),
            "HandleReloadConfigRequest": (pb.ReloadConfigRequest, pb.ReloadConfigResponse,
                                          plain("HandleReloadConfigRequest", self.reload_config)),
        })
        return (grpc.method_handlers_generic_handler(PREDICTION_SERVICE, prediction),
                grpc.method_handlers_generic_handler(MODEL_SERVICE, model))

    # -- PredictionService ----------------------------------------------------------------
    async def predict(self, request: Message, context: RequestContext = NO_CONTEXT) -> Message:
        name, version, label = _spec(request.model_spec)
        with observed(self.core.metrics, name, "predict"):
            signature_name = request.model_spec.signature_name or DEFAULT_SIGNATURE
            with await self.core.handles.handle(name, version, label) as held:
                if signature_name not in held.signatures:  # TF Serving's code and text (predict_util.cc)
                    raise FailedPrecondition(f'Serving signature key "{signature_name}" not found.')
                signature = held.signatures[signature_name]
                inputs = _inputs(request.inputs, signature)
                wanted = _output_filter(request.output_filter, signature)
                outputs = await held.run(signature.name, inputs, context)
                served = held.version
            response = pb.PredictResponse()
            _echo_spec(response.model_spec, name, served, signature_name)
            for key in wanted or outputs:
                to_tensor(outputs[key], response.outputs[key])
            return response

    async def classify(self, request: Message, context: RequestContext = NO_CONTEXT) -> Message:
        response = pb.ClassificationResponse()
        await self._examples_task(request.model_spec, request.input, "classify", response.model_spec,
                                  response.result, context)
        return response

    async def regress(self, request: Message, context: RequestContext = NO_CONTEXT) -> Message:
        response = pb.RegressionResponse()
        await self._examples_task(request.model_spec, request.input, "regress", response.model_spec,
                                  response.result, context)
        return response

    async def multi_inference(self, request: Message, context: RequestContext = NO_CONTEXT) -> Message:
        if not request.tasks:
            raise InvalidArgument("Expected at least one task")
        names = {t.model_spec.name for t in request.tasks}
        if len(names) > 1:
            raise InvalidArgument("All ModelSpecs in a MultiInferenceRequest must access the same model name")
        methods = {CLASSIFY_METHOD: "classify", REGRESS_METHOD: "regress"}
        response = pb.MultiInferenceResponse()
        for task in request.tasks:
            method = methods.get(task.method_name)
            if method is None:
                raise Unimplemented(f"Unsupported signature method_name: {task.method_name}")
            result = response.results.add()
            target = result.classification_result if method == "classify" else result.regression_result
            await self._examples_task(task.model_spec, request.input, method, result.model_spec, target, context)
        return response

    async def _examples_task(self, spec: Message, input_msg: Message, method: str, spec_out: Message, result: Message,
                             context: RequestContext) -> None:
        name, version, label = _spec(spec)
        with observed(self.core.metrics, name, method):
            signature_name = spec.signature_name or DEFAULT_SIGNATURE
            serialized = _examples(input_msg)
            served, signature, outputs = await run_examples(self.core.handles, serialized, name, version, label,
                                                            signature_name, method, context=context)
            _echo_spec(spec_out, name, served, signature_name)
            if method == "classify":
                _classifications(outputs, len(serialized), signature, result)
            else:
                _regressions(outputs, len(serialized), signature, result)

    async def metadata(self, request: Message) -> Message:
        name, version, label = _spec(request.model_spec)
        if not request.metadata_field:
            raise InvalidArgument("GetModelMetadataRequest must specify at least one metadata_field")
        for field in request.metadata_field:
            if field != "signature_def":
                raise InvalidArgument(f"Metadata field {field} is not supported")
        response = pb.GetModelMetadataResponse()
        with await self.core.handles.handle(name, version, label) as held:
            sigmap = pb.SignatureDefMap()
            for key, sig in held.signatures.items():
                _signature_def(sig, sigmap.signature_def[key])
            _echo_spec(response.model_spec, name, held.version, "")
        response.metadata["signature_def"].Pack(sigmap)
        return response

    # -- ModelService ---------------------------------------------------------------------
    async def model_status(self, request: Message) -> Message:
        name, version, label = _spec(request.model_spec)
        if self.states is None:
            raise Unavailable("model status is answered by the serving process")
        slots = self.states.version_states(name, version, label)
        if not slots:
            raise NotFound(f"Could not find any versions of model {name}")
        response = pb.GetModelStatusResponse()
        state_enum = "tensorflow.serving.ModelVersionStatus.State"
        for slot in slots:
            status = response.model_version_status.add(version=slot.version)
            status.state = pb.enum_value(state_enum, slot.state.value)
            status.status.error_code = pb.enum_value("tensorflow.error.Code",
                                                     (slot.error_code or "UNKNOWN") if slot.error else "OK")
            status.status.error_message = slot.error or ""
        return response

    async def reload_config(self, request: Message) -> Message:
        """Replace the served models with the request's ``model_config_list``, as TF Serving
        does: a model left out is unloaded; a refused config changes nothing."""
        which = request.config.WhichOneof("config")
        if which != "model_config_list":
            raise InvalidArgument("ServerModelConfig type not supported by HandleReloadConfigRequest. "
                                  "Only ModelConfigList is supported.")
        models = [model_config_from_proto(c) for c in request.config.model_config_list.config]
        new = copy.deepcopy(self.core.config)
        new.models, new.models_dir = models, ""
        try:
            validate_config(new)
        except ConfigError as exc:
            raise InvalidArgument(str(exc)) from exc
        if self.reload is None:
            raise Unavailable("a config reload is the serving process's to make")
        why = f"model config replaced by HandleReloadConfigRequest: {', '.join(m.name for m in models) or 'no models'}"
        await asyncio.get_running_loop().run_in_executor(None, self.reload, new, why)
        response = pb.ReloadConfigResponse()
        response.status.error_code = pb.enum_value("tensorflow.error.Code", "OK")
        return response


# -- request side ------------------------------------------------------------------------
def _spec(spec: Message) -> tuple[str, int | None, str | None]:
    if not spec.name:
        raise InvalidArgument("Missing ModelSpec")
    choice = spec.WhichOneof("version_choice")
    if choice == "version":
        return spec.name, int(spec.version.value), None
    if choice == "version_label":
        return spec.name, None, spec.version_label
    return spec.name, None, None


def _inputs(tensors: Mapping[str, Message], signature: SignatureInfo) -> dict[str, np.ndarray]:
    """The request's tensors, checked in TF Serving's order and words: the count
    (servables/tensorflow/predict_util.cc VerifyRequestInputsSize), the aliases, each tensor
    (``Tensor::FromProto``), then the dtypes as TensorFlow's session checks its feeds
    (FunctionCallFrame::SetArgs; ``arg[i]`` counts the signature's inputs in order)."""
    expected, sent = sorted(signature.inputs), sorted(tensors)
    if len(sent) != len(expected):
        raise InvalidArgument(
            f"input size does not match signature: {len(sent)}!={len(expected)} len({{{','.join(sent)}}}) != "
            f"len({{{','.join(expected)}}}). Sent extra: {{{','.join(k for k in sent if k not in signature.inputs)}}}. "
            f"Missing but required: {{{','.join(k for k in expected if k not in tensors)}}}.")
    for key in tensors:
        if key not in signature.inputs:
            raise InvalidArgument(f"input tensor alias not found in signature: {key}. "
                                  f"Inputs expected to be in the set {{{','.join(expected)}}}.")
    out = {}
    for index, (key, spec) in enumerate(signature.inputs.items()):
        try:
            array = from_tensor(tensors[key])
        except (ValueError, KeyError, IndexError) as exc:
            raise InvalidArgument(f"tensor parsing error: {key}") from exc
        want = spec.dtype
        if want is not None and array.dtype != want and not (want.kind == "O" and array.dtype.kind == "O"):
            raise InvalidArgument(f"Expects arg[{index}] to be {data_type_string(want)} but "
                                  f"{data_type_string(array.dtype)} is provided")
        out[key] = array
    return out


def from_tensor(tensor: Message) -> np.ndarray:
    """A request's TensorProto as numpy: appliance/protos/tfserving/wire.py reads the message
    (``tensor_content`` straight into numpy, typed fields with one ``fromiter``)."""
    return pw.tensor_to_array(tensor)


def _output_filter(names: Iterable[str], signature: SignatureInfo) -> list[str]:
    wanted = list(names)
    for name in wanted:
        if name not in signature.outputs:
            raise InvalidArgument(f"output tensor alias not found in signature: {name} Outputs expected to be "
                                  f"in the set {{{','.join(sorted(signature.outputs))}}}.")
    if len(set(wanted)) != len(wanted):
        raise InvalidArgument("duplicate output tensor alias in output_filter")
    return wanted


def _examples(input_msg: Message) -> np.ndarray:
    serialized = pw.input_examples(input_msg)
    if not serialized:
        raise InvalidArgument("Input is empty.")  # TF Serving's text
    return np.array(serialized, dtype=object)


# -- response side -----------------------------------------------------------------------
def _echo_spec(spec: Message, name: str, version: int, signature_name: str) -> None:
    spec.name = name
    spec.version.value = version
    spec.signature_name = signature_name


def to_tensor(array: np.ndarray, tensor: Message) -> None:
    """Fill a TensorProto from ``array`` in the typed fields, as TF Serving answers."""
    array = np.asarray(array)
    for size in array.shape:
        tensor.tensor_shape.dim.add(size=int(size))
    if array.dtype.kind in "OSU":
        tensor.dtype = 7  # DT_STRING
        tensor.string_val.extend(v if isinstance(v, bytes) else str(v).encode() for v in array.reshape(-1))
        return
    if array.dtype == np.float16:
        tensor.dtype = 19
        tensor.half_val.extend(array.reshape(-1).view(np.uint16).tolist())
        return
    field = _VAL_FIELD.get(array.dtype)
    if field is None:
        raise InvalidArgument(f"output dtype {array.dtype} has no TensorProto encoding here")
    tensor.dtype = pw.ENUM_OF[array.dtype]
    getattr(tensor, field).extend(array.reshape(-1).tolist())


def _signature_def(sig: SignatureInfo, out: Message) -> None:
    out.method_name = sig.method_name
    for side, specs in (("inputs", sig.inputs), ("outputs", sig.outputs)):
        for key, spec in specs.items():
            info = getattr(out, side)[key]
            info.name = spec.tensor_name or spec.name
            info.dtype = pw.ENUM_OF.get(spec.dtype, 0)
            if spec.shape is None:
                info.tensor_shape.unknown_rank = True
            else:
                for size in spec.shape:
                    info.tensor_shape.dim.add(size=-1 if size is None else int(size))


def _classifications(outputs: dict[str, np.ndarray], n: int, signature: SignatureInfo, result: Message) -> None:
    classes, scores, ref = classification_outputs(outputs, n)
    for i in range(n):
        row = result.classifications.add()
        for j in range(ref.shape[1]):
            item = row.classes.add()
            if classes is not None:
                text = classes[i, j]
                item.label = text.decode(errors="replace") if isinstance(text, bytes) else str(text)
            if scores is not None:
                item.score = float(scores[i, j])


def _regressions(outputs: dict[str, np.ndarray], n: int, signature: SignatureInfo, result: Message) -> None:
    for value in regression_values(signature, outputs, n).tolist():
        result.regressions.add(value=value)

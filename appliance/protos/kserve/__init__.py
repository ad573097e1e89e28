"""Messages of the KServe v2 gRPC service (``inference.GRPCInferenceService``).

``grpc_predict_v2.proto`` is the source; ``grpc_predict_v2_pb2`` is generated from it by
``scripts/gen_v2_protos.sh`` (protoc, then two edits explained there). At run time only
protobuf is needed: no grpcio-tools, no generated service stub.
"""

from appliance.protos.kserve import grpc_predict_v2_pb2 as pb
from appliance.protos.kserve import model_config_pb2  # Triton's ModelConfig (the ModelConfig RPC's answer)

__all__ = ["model_config_pb2", "pb"]

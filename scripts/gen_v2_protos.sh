#!/usr/bin/env bash
# Regenerate appliance/protos/kserve/grpc_predict_v2_pb2.py and model_config_pb2.py (and their .pyi
# for mypy) from grpc_predict_v2.proto and Triton's model_config.proto, which it imports.
#
#   scripts/gen_v2_protos.sh            # uses grpcio-tools from .venv, or installs it into a temp dir
#
# Two edits after protoc, both so the module works wherever the service runs:
# 1. The messages go into a private descriptor pool, not protobuf's default one (one pool for
#    both modules: model_config_pb2 makes it, grpc_predict_v2_pb2 imports it). Another
#    copy of the "inference.*" messages in the same process (tritonclient's grpc_service.proto,
#    a test that runs client and server together) would otherwise be a duplicate-symbol error.
# 2. protoc's runtime-version check is dropped: it ties the module to protoc's own protobuf
#    major, while the builder calls the module makes work on every protobuf from 4.21 on.
# The gRPC service itself needs no generated stub: appliance/api/kserve/grpc_service.py registers it with
# grpc.method_handlers_generic_handler.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
DIR=$ROOT/appliance/protos/kserve
if ! "$PY" -c "import grpc_tools" 2>/dev/null; then
  TOOLS=$(mktemp -d)
  trap 'rm -rf "$TOOLS"' EXIT
  "$PY" -m pip install -q --no-deps --target "$TOOLS" grpcio-tools
  export PYTHONPATH=$TOOLS${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -m grpc_tools.protoc -I "$DIR" --python_out="$DIR" --pyi_out="$DIR" "$DIR/model_config.proto" \
  "$DIR/grpc_predict_v2.proto"
"$PY" - "$DIR/model_config_pb2.py" "$DIR/grpc_predict_v2_pb2.py" "$DIR/grpc_predict_v2_pb2.pyi" <<'PY'
import re, sys
config, service, stub = sys.argv[1:]
for path, pool in ((config, "POOL = _POOL = _descriptor_pool.DescriptorPool()  # grpc_predict_v2_pb2 shares it\n"),
                   (service, "from appliance.protos.kserve.model_config_pb2 import POOL as _POOL\n")):
    src = open(path).read()
    src, checks = re.subn(r"_runtime_version\.ValidateProtobufRuntimeVersion\([^)]*\)\n", "", src)
    src = src.replace("from google.protobuf import runtime_version as _runtime_version\n", "")
    src, pools = re.subn(r"_descriptor_pool\.Default\(\)", "_POOL", src)
    assert pools == 1, "protoc output changed: expected one _descriptor_pool.Default() call"
    src = src.replace("import model_config_pb2 as", "from appliance.protos.kserve import model_config_pb2 as")
    src = src.replace("# @@protoc_insertion_point(imports)\n",
                      "# @@protoc_insertion_point(imports)\n\n"
                      "# Edited by scripts/gen_v2_protos.sh: a private pool (see there for why).\n" + pool, 1)
    open(path, "w").write(src)
text = open(stub).read()  # the stub's import of the other module, as a package path too
open(stub, "w").write(text.replace("import model_config_pb2 as", "from appliance.protos.kserve import model_config_pb2 as"))
PY
echo "wrote $DIR/model_config_pb2.py and $DIR/grpc_predict_v2_pb2.py"

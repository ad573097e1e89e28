"""TLS for the gRPC port: TF Serving's ``--ssl_config_file``, or the REST port's certificate.

Two ways to turn it on (``[grpc]``), never both:

- ``ssl_config_file``: TF Serving's own file, an ASCII ``tensorflow.serving.SSLConfig``
  protobuf (``server_key``, ``server_cert``, ``custom_ca``, ``client_verify``: the PEM
  texts themselves, not paths), read as tensorflow_model_server reads it (server.cc
  ``BuildServerCredentials``): with ``client_verify`` a client must present a certificate
  that ``custom_ca`` (else the system's CAs) signed, without it none is asked for;
- ``tls = true``: the REST port's ``[security] tls_cert_file``, ``tls_key_file``,
  ``tls_client_ca_file`` (client certificates required when set) and ``tls_min_version``.

``grpc_tls(config)`` reads and checks them at start-up (a bad file stops it with the key that
names it) into a ``GRPCTLS``: an ``ssl.SSLContext`` for the lean server (ALPN h2, TLS 1.2 at
least, as gRPC requires) and the PEM texts for grpcio's ``ssl_server_credentials``. The Unix
socket (``[grpc] socket_path``) stays plaintext: its file permissions say who may call.
"""

from __future__ import annotations

import os
import ssl
import tempfile
from dataclasses import dataclass
from typing import Any

from appliance.core.config import Config, SecurityConfig
from appliance.core.errors import ConfigError
from appliance.core.tls import credential_path, tls_context


@dataclass(frozen=True)
class GRPCTLS:
    """What both gRPC servers need: PEM texts (grpcio) and the context made from them (lean)."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None  # PEM CAs that sign client certificates (None: the system's)
    require_client_certificate: bool
    context: ssl.SSLContext

    def describe(self) -> dict[str, Any]:
        return {"tls": True, "client_certificates": "required" if self.require_client_certificate else "not asked"}


def grpc_tls(config: Config) -> GRPCTLS | None:
    """The gRPC port's TLS from ``[grpc]`` (module docstring); None when it is plaintext."""
    cfg = config.grpc
    if cfg.ssl_config_file and cfg.tls:
        raise ConfigError("grpc.tls", "set either grpc.tls (the REST port's certificate) or grpc.ssl_config_file "
                          "(TF Serving's SSLConfig), not both")
    if cfg.ssl_config_file:
        return _from_ssl_config(credential_path(cfg.ssl_config_file))
    if cfg.tls:
        return _from_security(config.security)
    return None


def _from_security(security: SecurityConfig) -> GRPCTLS:
    if not security.tls_cert_file:
        raise ConfigError("grpc.tls", "gRPC over TLS uses [security] tls_cert_file and tls_key_file: set them "
                          "(or give grpc.ssl_config_file)")
    context = tls_context(security)  # the REST port's checks and error messages, key by key
    context.set_alpn_protocols(["h2"])
    ca = credential_path(security.tls_client_ca_file) if security.tls_client_ca_file else ""
    return GRPCTLS(_read(credential_path(security.tls_cert_file), "security.tls_cert_file"),
                   _read(credential_path(security.tls_key_file), "security.tls_key_file"),
                   _read(ca, "security.tls_client_ca_file") if ca else None, bool(ca), context)


def _from_ssl_config(path: str) -> GRPCTLS:
    message = parse_ssl_config(_read(path, "grpc.ssl_config_file").decode("utf-8", "replace"), path)
    if not message.server_key or not message.server_cert:
        raise ConfigError("grpc.ssl_config_file", f"{path}: server_key and server_cert must both be set (the PEM "
                          "texts themselves, as TF Serving reads them)")
    cert, key = message.server_cert.encode(), message.server_key.encode()
    ca = message.custom_ca.encode() if message.custom_ca else None
    context = _context(cert, key, ca, bool(message.client_verify), path)
    return GRPCTLS(cert, key, ca, bool(message.client_verify), context)


def _context(cert: bytes, key: bytes, ca: bytes | None, verify: bool, path: str) -> ssl.SSLContext:
    """A server context from PEM texts: ssl takes the chain and key only from files, so they
    pass through a private temporary directory that is gone before this returns."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2"])
    with tempfile.TemporaryDirectory(prefix="grpc-tls-") as directory:  # mode 0700
        cert_path, key_path = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
        for target, data in ((cert_path, cert), (key_path, key)):
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        try:
            context.load_cert_chain(cert_path, key_path)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError("grpc.ssl_config_file", f"{path}: server_cert and server_key are not a PEM "
                              f"certificate chain and its unencrypted private key: {exc}") from exc
    if verify:
        try:
            context.load_verify_locations(cadata=ca.decode()) if ca else context.load_default_certs()
        except (ssl.SSLError, ValueError) as exc:
            raise ConfigError("grpc.ssl_config_file", f"{path}: custom_ca is not PEM certificates: {exc}") from exc
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def parse_ssl_config(text: str, path: str = "ssl_config_file") -> Any:
    """TF Serving's ``SSLConfig`` text proto (tensorflow_serving/config/ssl_config.proto), by
    protobuf's own text parser; ConfigError naming the file and protobuf's reason."""
    from google.protobuf import text_format

    message = _ssl_config_class()()
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as exc:
        raise ConfigError("grpc.ssl_config_file", f"{path} is not a tensorflow.serving.SSLConfig text proto: "
                          f"{exc}") from exc
    return message


_SSL_CONFIG: Any = None


def _ssl_config_class() -> Any:
    """``tensorflow.serving.SSLConfig``, built from its four fields in a private pool (the
    tensorflow-serving-api package does not ship ssl_config.proto)."""
    global _SSL_CONFIG
    if _SSL_CONFIG is None:
        from google.protobuf import descriptor_pb2, descriptor_pool

        proto = descriptor_pb2.FileDescriptorProto(name="tensorflow_serving/config/ssl_config.proto",
                                                   package="tensorflow.serving", syntax="proto3")
        message = proto.message_type.add(name="SSLConfig")
        kinds = descriptor_pb2.FieldDescriptorProto
        for number, (name, kind) in enumerate((("server_key", kinds.TYPE_STRING), ("server_cert", kinds.TYPE_STRING),
                                               ("custom_ca", kinds.TYPE_STRING), ("client_verify", kinds.TYPE_BOOL)), 1):
            message.field.add(name=name, number=number, type=kind, label=kinds.LABEL_OPTIONAL)
        pool = descriptor_pool.DescriptorPool()
        pool.Add(proto)
        descriptor = pool.FindMessageTypeByName("tensorflow.serving.SSLConfig")
        try:
            from google.protobuf.message_factory import GetMessageClass
        except ImportError:  # protobuf < 4.22
            from google.protobuf.message_factory import MessageFactory

            _SSL_CONFIG = MessageFactory(pool).GetPrototype(descriptor)
        else:
            _SSL_CONFIG = GetMessageClass(descriptor)
    return _SSL_CONFIG


def _read(path: str, key: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(key, f"cannot read {path}: {exc.strerror or exc}") from exc

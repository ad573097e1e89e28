"""The REST port's TLS context from ``[security]``: made before the port is bound, so a bad
certificate or key stops start-up with the config key that names it."""

from __future__ import annotations

import os
import ssl

from appliance.core.config import SecurityConfig
from appliance.core.errors import ConfigError


def credential_path(name: str) -> str:
    """An absolute path as is; a bare name in systemd's $CREDENTIALS_DIRECTORY (LoadCredential=),
    so a key only root may read reaches the service user without loosening its mode."""
    directory = os.environ.get("CREDENTIALS_DIRECTORY", "")
    if os.path.isabs(name) or not directory or os.sep in name:
        return name
    return os.path.join(directory, name)


def tls_context(security: SecurityConfig) -> ssl.SSLContext:
    """The server's TLS context from ``[security]``; ConfigError naming the key on a bad file."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3 if security.tls_min_version == "TLSv1.3" else ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])
    cert, key = credential_path(security.tls_cert_file), credential_path(security.tls_key_file)
    try:
        ctx.load_cert_chain(cert, key)
    except FileNotFoundError as exc:
        name = "security.tls_cert_file" if exc.filename in (None, cert) else "security.tls_key_file"
        raise ConfigError(name, f"cannot read {exc.filename or cert}: {exc.strerror}") from exc
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError("security.tls_cert_file", f"{cert} and {key} are not a PEM certificate chain and "
                          f"its unencrypted private key: {exc}") from exc
    if security.tls_client_ca_file:
        ca = credential_path(security.tls_client_ca_file)
        try:
            ctx.load_verify_locations(cafile=ca)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError("security.tls_client_ca_file", f"cannot load {ca}: {exc}") from exc
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx

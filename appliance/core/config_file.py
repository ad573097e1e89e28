"""The configuration as read at start-up and on each reload: the TOML file (or none: every
key has a default), dotted-key overrides from the command line, and TF Serving's own files when
``[tfs]`` names them (appliance/core/tfs_files.py), then validated (appliance/core/config.py).
A bad value fails with its key's name and the reason (``ConfigError``)."""

from __future__ import annotations

import tomllib
from typing import Any

from appliance.core.config import Config, build, set_field, validate
from appliance.core.errors import ConfigError


def load(path: str | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Read ``path`` (None: defaults only), apply dotted-key ``overrides``, validate."""
    data: dict[str, Any] = {}
    if path:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as exc:
            raise ConfigError("--config", f"cannot read {path}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("--config", f"{path} is not valid TOML: {exc}") from exc
    config = build(Config, data, "")
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        *parents, leaf = dotted.split(".")
        target = config
        for part in parents:
            target = getattr(target, part)
        set_field(target, leaf, value, ".".join(parents))
    if config.tfs.model_config_file or config.tfs.batching_parameters_file or config.tfs.monitoring_config_file:
        from appliance.core.tfs_files import apply  # TF Serving's own files; protobuf only when used

        apply(config)
    return validate(config)

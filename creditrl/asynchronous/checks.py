"""The config checks that need ``creditrl.asynchronous``'s transport (what a loopback address
is), registered with ``creditrl.config.checks``."""

from __future__ import annotations

from creditrl.config.checks import register_config_check
from creditrl.config.schema import Config
from creditrl.errors import ConfigError
from creditrl.hosts import is_loopback

__all__: list[str] = []


@register_config_check("endpoint_host")
def _check_endpoint_host(cfg: Config) -> None:
    """agent.endpoint_host is a loopback address unless agent.endpoint_allow_remote=true (the
    endpoint speaks plain HTTP; '' and 0.0.0.0 would serve every interface)."""
    host = cfg.agent.endpoint_host
    if not is_loopback(host) and not cfg.agent.endpoint_allow_remote:
        raise ConfigError(
            f"agent.endpoint_host={host!r} is not a loopback address: the endpoint serves plain "
            "HTTP (the run's key in clear) on it; use 127.0.0.1, or set "
            "agent.endpoint_allow_remote=true"
        )

"""The config checks that need ``creditrl.asynchronous``'s transport (what a loopback address
is, which channel carries weights), registered with ``creditrl.config.checks``."""

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


@register_config_check("weight_channel")
def _check_weight_channel(cfg: Config) -> None:
    """asynchronous.weight_channel=wire needs an engine that takes weights as tensors (one that
    reads a published folder itself has only the folder); weight_port and weight_rate_mb
    apply to the wire, so weight_channel=folder refuses them; weight_port is not port."""
    from creditrl.rollout import engine_traits

    a = cfg.asynchronous
    if a.weight_channel == "wire" and engine_traits(cfg.rollout.engine).weights_via == "folder":
        raise ConfigError(
            f"asynchronous.weight_channel=wire: rollout.engine={cfg.rollout.engine} reads "
            "published weight folders itself; use weight_channel=folder (or auto)"
        )
    if a.weight_channel == "folder" and (a.weight_port or a.weight_rate_mb):
        key = "weight_port" if a.weight_port else "weight_rate_mb"
        raise ConfigError(
            f"asynchronous.{key} applies to weights over the wire, which "
            "asynchronous.weight_channel=folder does not use; unset it or use wire (or auto)"
        )
    if a.weight_port and a.weight_port == a.port:
        raise ConfigError(
            f"asynchronous.weight_port={a.weight_port} is asynchronous.port: give the weights "
            "a port of their own (0: port + 1)"
        )

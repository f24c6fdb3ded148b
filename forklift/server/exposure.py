"""Who may reach the trainer routes: they replace weights and pause the engine, so they are
off unless asked for, and never open to the network without an API key."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost may resolve to anything
        return False


def check_trainer_routes_exposure(host: str, api_key: str | None, enabled: bool) -> None:
    """Refuse to serve trainer routes on a non-loopback address without an API key."""
    if enabled and api_key is None and not is_loopback(host):
        raise ValueError(
            f"--enable-trainer-routes on --host {host} would let anyone who reaches the port "
            "replace the weights or pause the engine: add --api-key KEY (trainers then send "
            "'Authorization: Bearer KEY'), or serve on --host 127.0.0.1"
        )

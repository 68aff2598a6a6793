"""A local HTTPS server that answers like Kubeflow Trainer v2.3.0's TrainJob status server, for the tests.

Modelled on kubeflow/trainer v2.3.0, read at the tag:

- ``pkg/statusserver/server.go``: only ``POST /apis/trainer.kubeflow.org/v1alpha1/namespaces/{namespace}/trainjobs/
  {name}/status`` is served; every other method or path is 404 "Not found" (the mux's ``/`` handler). Then the
  token check (403 "Forbidden" when it fails), then ``json.Decoder.Decode`` into ``UpdateTrainJobStatusRequest``
  (Go's decoding: keys matched without regard to case, unknown keys ignored, text after the first JSON value
  ignored, a number with a fraction or beyond int32 into an ``int32`` field fails): 422 "Invalid payload". A
  request without ``trainerStatus`` is 200 and applies nothing. Then a server-side apply of the status, whose
  schema errors come back as 422 with the API server's message, a missing TrainJob as 404 "Train job not found".
  Errors are ``metav1.Status`` objects; 200 echoes the decoded request.
- ``pkg/statusserver/middleware.go``: a ``Content-Length`` above 64 KiB is 413 "Payload too large".
- ``pkg/statusserver/auth.go``: ``Authorization`` split on whitespace must be exactly ``Bearer <token>`` (the
  scheme in any case); the token is verified by go-oidc (``IDTokenVerifier.Verify`` in ``oidc/verify.go``, read at
  coreos/go-oidc v3.10.0; the Trainer pins v3.20.0): issuer, audience containing ``trainer.kubeflow.org/v1alpha1/
  namespaces/<ns>/trainjobs/<name>/status`` (``utils.go``), expiry, ``nbf`` with 5 minutes of leeway, an RS256
  signature; then the ``kubernetes.io.namespace`` claim must be the TrainJob's namespace.
- ``pkg/apis/trainer/v1alpha1/trainjob_types.go`` (the CRD's schema the API server applies): progressPercentage
  0-100, estimatedRemainingSeconds >= 0, at most 256 metrics whose name and value have 1-64 characters, and the
  CEL rule "lastUpdatedTime is required when trainerStatus is present".

The CA and serving certificate are made like the webhook certificates the status server reuses (a CA that signs
the serving certificate: ``pkg/util/cert/cert.go``), for ``localhost``; the tokens are RS256 JWTs shaped like
projected service account tokens.
"""

from __future__ import annotations

import base64
import datetime
import json
import re
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID

ISSUER = "https://kubernetes.default.svc.cluster.local"
PATH = re.compile(r"^/apis/trainer\.kubeflow\.org/v1alpha1/namespaces/([^/]+)/trainjobs/([^/]+)/status$")
MAX_BODY = 1 << 16
INT32_MAX = 2**31 - 1
RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")


def audience(namespace: str, name: str) -> str:
    return f"trainer.kubeflow.org/v1alpha1/namespaces/{namespace}/trainjobs/{name}/status"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def make_tls(folder: Path) -> Tuple[Path, Path, Path]:
    """A CA and a serving certificate for ``localhost`` signed by it: ``(ca.crt, tls.crt, tls.key)``."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = _key(), _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    leaf = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = folder / "ca.crt", folder / "tls.crt", folder / "tls.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


class TokenIssuer:
    """Signs projected-service-account-shaped JWTs (RS256) as the cluster's issuer does."""

    def __init__(self) -> None:
        self.key = _key()

    def token(self, namespace: str, name: str, lifetime_s: float = 3600, now: Optional[float] = None,
              aud: Optional[str] = None, pod_namespace: Optional[str] = None) -> str:
        now = time.time() if now is None else now
        claims = {"aud": [aud or audience(namespace, name)], "exp": int(now + lifetime_s), "iat": int(now),
                  "nbf": int(now), "iss": ISSUER, "sub": f"system:serviceaccount:{namespace}:default",
                  "kubernetes.io": {"namespace": pod_namespace or namespace, "pod": {"name": f"{name}-node-0-0"},
                                    "serviceaccount": {"name": "default"}}}
        signing = f"{_b64(json.dumps({'alg': 'RS256', 'kid': 'k1'}).encode())}.{_b64(json.dumps(claims).encode())}"
        signature = self.key.sign(signing.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing}.{_b64(signature)}"

    def verify(self, raw: str, namespace: str, name: str, now: float) -> bool:
        """go-oidc's checks, then the Trainer's namespace check (``auth.go``)."""
        try:
            head, body, signature = raw.split(".")
            claims = json.loads(_unb64(body))
            if json.loads(_unb64(head)).get("alg") != "RS256":
                return False
            if claims.get("iss") != ISSUER or audience(namespace, name) not in _audiences(claims.get("aud")):
                return False
            if claims["exp"] < now or ("nbf" in claims and now + 300 < claims["nbf"]):
                return False
            self.key.public_key().verify(_unb64(signature), f"{head}.{body}".encode(), padding.PKCS1v15(),
                                         hashes.SHA256())
            return (claims.get("kubernetes.io") or {}).get("namespace") == namespace
        except Exception:  # noqa: BLE001 - any malformed token is a refusal, as Verify's error is
            return False


def _audiences(aud: Any) -> List[str]:
    return [aud] if isinstance(aud, str) else list(aud or [])


class Invalid(Exception):
    """What the API server (422 with its message) or the decoder (422 "Invalid payload") rejects."""


def _field(obj: Dict[str, Any], name: str) -> Any:
    """``encoding/json``'s key matching: the exact key, else one equal without regard to case."""
    if name in obj:
        return obj[name]
    return next((v for k, v in obj.items() if k.lower() == name.lower()), None)


def _int32(value: Any) -> Optional[int]:
    if value is None:
        return None
    if type(value) is not int or not -2**31 <= value <= INT32_MAX:  # 45.0, 1e2, true, "45" do not decode
        raise Invalid("Invalid payload")
    return value


def decode(body: bytes) -> Optional[Dict[str, Any]]:
    """The request's ``trainerStatus`` as Go decodes it (None when absent), or ``Invalid("Invalid payload")``."""
    try:
        text = body.decode()
        request, _ = json.JSONDecoder().raw_decode(text, len(text) - len(text.lstrip()))  # the first value only
    except (UnicodeDecodeError, ValueError):
        raise Invalid("Invalid payload") from None
    if not isinstance(request, dict):
        raise Invalid("Invalid payload")
    status = _field(request, "trainerStatus")
    if status is None:
        return None
    if not isinstance(status, dict):
        raise Invalid("Invalid payload")
    metrics = _field(status, "metrics")
    if metrics is not None and (not isinstance(metrics, list) or not all(isinstance(m, dict) for m in metrics)):
        raise Invalid("Invalid payload")
    decoded_metrics = []
    for metric in metrics or []:
        name, value = _field(metric, "name"), _field(metric, "value")
        if not all(v is None or isinstance(v, str) for v in (name, value)):
            raise Invalid("Invalid payload")
        decoded_metrics.append({"name": name or "", "value": value or ""})
    updated = _field(status, "lastUpdatedTime")
    if updated is not None and (not isinstance(updated, str) or not RFC3339.match(updated)):
        raise Invalid("Invalid payload")  # metav1.Time.UnmarshalJSON: time.Parse(time.RFC3339, ...)
    return {"progressPercentage": _int32(_field(status, "progressPercentage")),
            "estimatedRemainingSeconds": _int32(_field(status, "estimatedRemainingSeconds")),
            "metrics": decoded_metrics, "lastUpdatedTime": updated}


def validate(status: Dict[str, Any], name: str) -> None:
    """The CRD's schema and CEL rule, as the API server applies them to the status."""
    prefix, errors = "status.trainerStatus", []
    progress, eta = status["progressPercentage"], status["estimatedRemainingSeconds"]
    if progress is not None and not 0 <= progress <= 100:
        errors.append(f"{prefix}.progressPercentage: Invalid value: {progress}: {prefix}.progressPercentage in body "
                      f"should be {'greater than or equal to 0' if progress < 0 else 'less than or equal to 100'}")
    if eta is not None and eta < 0:
        errors.append(f"{prefix}.estimatedRemainingSeconds: Invalid value: {eta}: {prefix}.estimatedRemainingSeconds "
                      "in body should be greater than or equal to 0")
    if len(status["metrics"]) > 256:
        errors.append(f"{prefix}.metrics: Too many: {len(status['metrics'])}: must have at most 256 items")
    for i, metric in enumerate(status["metrics"]):
        for key in ("name", "value"):
            if not 1 <= len(metric[key]) <= 64:
                errors.append(f"{prefix}.metrics[{i}].{key}: Invalid value: \"{metric[key]}\": must have 1 to 64 "
                              "characters")
    if status["lastUpdatedTime"] is None:
        errors.append(f"{prefix}: Invalid value: \"object\": lastUpdatedTime is required when trainerStatus is present")
    if errors:
        raise Invalid(f"TrainJob.trainer.kubeflow.org \"{name}\" is invalid: [{', '.join(errors)}]")


@dataclass
class Received:
    """One request the server answered."""

    at: float
    code: int
    token: str
    body: Dict[str, Any]


@dataclass
class StatusServer:
    """The server's state: the TrainJobs it knows, what they hold, every request, and how to misbehave."""

    issuer: TokenIssuer
    trainjobs: Dict[Tuple[str, str], Optional[Dict[str, Any]]] = field(default_factory=dict)
    received: List[Received] = field(default_factory=list)
    clock_skew_s: float = 0.0  # added to the server's clock (a test ages tokens with it)
    fail_with: Optional[int] = None  # answer every request with this status (the API server failing)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def handle(self, method: str, path: str, headers: Dict[str, str], body: bytes) -> Tuple[int, Dict[str, Any]]:
        match = PATH.match(path.split("?")[0])
        if method != "POST" or match is None:
            return _status(404, "Not found", "NotFound")
        namespace, name = match.groups()
        parts = headers.get("authorization", "").split()
        token = parts[1] if len(parts) == 2 and parts[0].lower() == "bearer" else ""
        if not self.issuer.verify(token, namespace, name, time.time() + self.clock_skew_s):
            return _status(403, "Forbidden", "Forbidden")
        try:
            status = decode(body)
        except Invalid:
            return _status(422, "Invalid payload", "Invalid")
        if status is None:
            return 200, {}
        if self.fail_with is not None:
            return _status(self.fail_with, "Internal error", "InternalError")
        try:
            validate(status, name)
        except Invalid as error:
            return _status(422, str(error), "Invalid")
        if (namespace, name) not in self.trainjobs:
            return _status(404, "Train job not found", "NotFound")
        self.trainjobs[(namespace, name)] = status
        return 200, {"trainerStatus": {k: v for k, v in status.items() if v not in (None, [])}}


def _status(code: int, message: str, reason: str) -> Tuple[int, Dict[str, Any]]:
    return code, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
                  "reason": reason, "code": code}


class _Handler(BaseHTTPRequestHandler):
    server: "_HTTPServer"

    def _answer(self) -> None:
        state = self.server.state
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            code, answer = _status(413, "Payload too large", "RequestEntityTooLarge")
            body = {}
        else:
            raw = self.rfile.read(length)
            with state.lock:
                code, answer = state.handle(self.command, self.path, {k.lower(): v for k, v in self.headers.items()},
                                            raw)
            try:
                body = json.loads(raw) if raw else {}
            except ValueError:
                body = {}
        parts = (self.headers.get("Authorization") or "").split()
        with state.lock:
            state.received.append(Received(time.time(), code, parts[-1] if parts else "", body))
        data = json.dumps(answer).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_POST = do_GET = do_PUT = do_PATCH = _answer

    def log_message(self, *args) -> None:
        pass


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    state: StatusServer


def serve(state: StatusServer, cert: Path, key: Path) -> Tuple[_HTTPServer, int]:
    """Serves ``state`` over TLS on a loopback port, on a daemon thread; returns the server and its port."""
    httpd = _HTTPServer(("127.0.0.1", 0), _Handler)
    httpd.state = state
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    return httpd, httpd.server_address[1]


def silent_listener() -> Tuple[socket.socket, int]:
    """A port that accepts connections and never answers (a controller that hangs)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    return listener, listener.getsockname()[1]

"""URIs without their secrets, for everything domino writes where other people read: log lines, the run
pointer on the shared volume, MLflow parameters and tags, the smoke test's report.

A tracking URI may carry a password in its userinfo (``http://alice:pw@host``: MLflow passes the URI on as the
request's host, ``mlflow/utils/credentials.py:get_default_host_creds`` in mlflow 3.18.0, and requests 2.33.0 turns
the userinfo into basic auth, ``requests/models.py:PreparedRequest.prepare_auth``), a token as the whole userinfo
(``https://TOKEN@host``), or a signature in its query (a presigned S3 URL's ``X-Amz-Signature``). MLflow's own
errors quote the URI whole (``API request to {url} failed``, ``mlflow/utils/rest_utils.py``), so free text that
may hold one goes through :func:`redact_text`.

The userinfo is replaced whole (a user name alone may be a token); a query parameter whose name looks like a
credential keeps its name and loses its value. Everything else is left byte for byte, so two spellings of one
server stay two spellings.
"""

from __future__ import annotations

import re

#: What stands where a secret was.
HIDDEN = "***"
#: ``scheme://userinfo@`` (or ``userinfo@`` with no scheme): the userinfo runs to the authority's last ``@``.
_USERINFO = re.compile(r"^(?P<head>(?:[A-Za-z][A-Za-z0-9+.-]*://)?)[^/?#]*@")
#: Query parameter names that carry credentials (matched anywhere in the name, case-insensitive):
#: ``access_token``, ``api_key``, ``X-Amz-Signature``/``X-Amz-Credential``/``X-Amz-Security-Token`` (S3),
#: ``sig``/``se`` (Azure SAS), ``X-Goog-Signature`` (GCS), ``password``, ``secret``, ``auth``.
_SECRET_NAME = re.compile(r"token|passw|pwd|secret|key|sig|credential|auth|^x-amz-|^x-goog-|^se$", re.IGNORECASE)
#: A URI inside free text: a scheme, ``://``, and everything up to white space or a quote.
_URI_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def redact_uri(uri: str) -> str:
    """``uri`` without userinfo and with the values of credential-like query parameters hidden.

    ``http://alice:pw@host:5000/x?token=t&a=1#f`` -> ``http://***@host:5000/x?token=***&a=1#f``;
    ``file:``, ``databricks://profile`` and plain paths come back unchanged.
    """
    uri = _USERINFO.sub(lambda m: f"{m['head']}{HIDDEN}@", uri, count=1)
    head, mark, rest = uri.partition("?")
    if not mark:
        return uri
    query, hash_mark, fragment = rest.partition("#")
    parts = []
    for part in re.split(r"([&;])", query):
        name, equals, _ = part.partition("=")
        parts.append(f"{name}={HIDDEN}" if equals and _SECRET_NAME.search(name) else part)
    return f"{head}?{''.join(parts)}{hash_mark}{fragment}"


def redact_text(text: str) -> str:
    """``text`` (an error message, a log line) with every ``scheme://...`` URI in it redacted."""
    return _URI_IN_TEXT.sub(lambda m: redact_uri(m.group(0)), text)

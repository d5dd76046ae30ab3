"""API keys (head.api_keys): with keys set, a request to a /v1 route must carry one, as the OpenAI clients send their
`api_key`: `Authorization: Bearer <key>`.

A request without a key, or with one that is not among them, gets a 401 before its route's handler runs: its body
is not parsed, and nothing is queued or generated for it. /health, /health/ready and /metrics stay open (load
balancers, uptime monitors and Prometheus ask without keys; they say nothing of prompts), and so does a browser's
CORS preflight, which never carries credentials: the request it announces is checked as any other. Keys are
compared in constant time, each of them every time, and never logged.
"""
from __future__ import annotations

import hmac

import falcon

PROTECTED_PREFIX = "/v1/"


class Unauthorized(Exception):
    """A request to a protected route without one of the server's keys (api.error_reply: a 401)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


MISSING = ("You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer "
           "auth (i.e. Authorization: Bearer YOUR_KEY; an OpenAI client sends its api_key so). This server's keys "
           "are its topology's head.api_keys.")
# the header's value is not echoed: a key sent without its scheme ("Authorization: sk-...") would be
NOT_BEARER = ("The Authorization header must use Bearer auth (i.e. Authorization: Bearer YOUR_KEY; an OpenAI client "
              "sends its api_key so).")
WRONG = "Incorrect API key provided: it is not one of this server's keys (its topology's head.api_keys)."


class ApiKeys:
    """Falcon middleware: refuses a request to a /v1 route unless it carries one of `keys` (module doc)."""

    def __init__(self, keys: tuple[str, ...]):
        if not keys:
            raise ValueError("no API keys: leave the middleware out for an open API")
        self._keys = tuple(key.encode("ascii") for key in keys)  # topology.py takes printable ASCII only

    def process_resource(self, req: falcon.Request, resp: falcon.Response, resource: object,
                         params: dict) -> None:
        # after routing (a URL no route takes gets its 404 as before): the refusal is counted under its route
        # the path as the router reads it, leading slashes as one: Waitress makes "//v1/models" "/v1/models", but
        # under another WSGI server the router would serve it and the prefix would not match it
        if req.method == "OPTIONS" or not ("/" + req.path.lstrip("/") + "/").startswith(PROTECTED_PREFIX):
            return
        header = req.get_header("Authorization")
        if header is None or not header.strip():
            raise Unauthorized(MISSING)
        scheme, _, given = header.strip().partition(" ")
        if scheme.lower() != "bearer":
            raise Unauthorized(NOT_BEARER)
        if not given.strip():
            raise Unauthorized(MISSING)
        # WSGI gives header values as latin-1 text: these are the bytes the client sent
        sent = given.strip().encode("latin-1", "replace")
        if not sum(hmac.compare_digest(sent, key) for key in self._keys):  # every key compared, match or not
            raise Unauthorized(WRONG)

"""The dashboard's HTTP server: the page, its live feed, a JSON snapshot and Prometheus metrics,
all behind one access token.

Routes: `/` (the page; `/?token=T` sets a session cookie and redirects to `/`), `/static/<file>`
(the page's assets, shipped in the package: no CDN), `/api/state` (the snapshot as JSON),
`/events` (server-sent events: the snapshot whenever it changes, at most once a second) and
`/metrics` (Prometheus text format). Every route needs the token: as `?token=`, as the
`edgetrain_dashboard` cookie or as `Authorization: Bearer T` (what Prometheus sends). Without it
the answer is 401 and nothing else. With a `tls` identity (the gateway's certificate) it serves
HTTPS, which is how it must be reached from the LAN.
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import ssl
import tempfile
import threading
import time
from collections.abc import Callable
from http import cookies
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from edgetrain import trust
from edgetrain.config import ConfigError
from edgetrain.trust import Identity

logger = logging.getLogger(__name__)

COOKIE = "edgetrain_dashboard"
EVENT_INTERVAL_S = 1.0
"""How often the live feed looks for a change."""
STATIC_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}


def new_token() -> str:
    """A fresh access token (192 random bits, URL-safe)."""
    return secrets.token_urlsafe(24)


class DashboardServer:
    """Serves `snapshot()` on `bind` ("host:port"; port 0 picks a free one) until `close()`."""

    def __init__(self, bind: str, snapshot: Callable[[], dict], *, token: str | None = None,
                 tls: Identity | None = None) -> None:
        host, _, port = bind.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--dashboard wants HOST:PORT, got {bind!r}")
        self.token = token or new_token()
        self._source = snapshot
        self._shared_lock = threading.Lock()
        self._shared: tuple[float, dict, str] | None = None
        self._closed = threading.Event()
        self._http = ThreadingHTTPServer((host.strip("[]"), int(port)), _handler_for(self))
        self._http.daemon_threads = True
        self.scheme = "http"
        if tls is not None:
            # the handshake runs in the request's thread (on its first read), not in the accept loop
            self._http.socket = _tls_context(tls).wrap_socket(self._http.socket, server_side=True,
                                                              do_handshake_on_connect=False)
            self.scheme = "https"
        self.host = host
        self.port = self._http.server_address[1]
        self.url_file: Path | None = None
        """Where `serve_dashboard` wrote the URL (removed on close: `edgetrain dashboard` lists live pages)."""
        self._thread = threading.Thread(target=self._http.serve_forever, name="dashboard", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """The address to open, token included (it grants access: share it as a password)."""
        return f"{self.scheme}://{self.host}:{self.port}/?token={self.token}"

    @property
    def closed(self) -> threading.Event:
        return self._closed

    def close(self) -> None:
        if self.url_file is not None:
            self.url_file.unlink(missing_ok=True)
        self._closed.set()
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=5)

    def snapshot(self) -> dict:
        return self.shared()[0]

    def shared(self) -> tuple[dict, str]:
        """The snapshot and its JSON, made at most once per EVENT_INTERVAL_S whoever asks (every
        open page, /api/state and /metrics share it: more viewers cost the run nothing more)."""
        with self._shared_lock:
            now = time.monotonic()
            if self._shared is None or now - self._shared[0] >= EVENT_INTERVAL_S:
                state = self._source()
                self._shared = (now, state, json.dumps(state))
            return self._shared[1], self._shared[2]

    def allows(self, presented: str | None) -> bool:
        return presented is not None and hmac.compare_digest(presented.encode(), self.token.encode())


def serve_dashboard(bind: str, snapshot: Callable[[], dict], url_file: Path,
                    authority: trust.Authority | None) -> DashboardServer:
    """Serve `snapshot` on `bind`: over HTTPS with the gateway's certificate unless the host is
    loopback or there is no fleet authority (`--insecure`, which is said on the log). Its URL,
    token included, is logged and written to `url_file`, readable by its owner only."""
    host = bind.rsplit(":", 1)[0].strip("[]")
    loopback = host in ("127.0.0.1", "::1", "localhost")
    tls = authority.gateway_identity() if authority is not None and not loopback else None
    try:
        page = DashboardServer(bind, snapshot, tls=tls)
    except OSError as e:  # the port is taken, the address is not this machine's
        raise ConfigError(f"--dashboard {bind}: cannot listen there ({e.strerror or e})") from None
    url_file.parent.mkdir(parents=True, exist_ok=True)
    url_file.unlink(missing_ok=True)
    url_file.touch(mode=0o600)
    url_file.write_text(page.url + "\n")
    page.url_file = url_file
    if tls is None and not loopback:
        logger.warning("[Dashboard] serving on %s WITHOUT TLS (--insecure): its token crosses the network in the "
                       "clear", bind)
    logger.info("[Dashboard] %s (the token in it grants access; also in %s)", page.url, url_file)
    return page


def _tls_context(identity: Identity) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    with tempfile.TemporaryDirectory(prefix="edgetrain-dashboard-") as tmp:  # ssl reads files only
        cert, key = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
        cert.write_bytes(identity.cert + identity.ca)
        key.touch(mode=0o600)
        key.write_bytes(identity.key)
        context.load_cert_chain(cert, key)
    return context


def _handler_for(server: DashboardServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "edgetrain-dashboard"

        def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
            logger.debug("[Dashboard] %s %s", self.address_string(), format % args)

        def _token(self) -> str | None:
            query = parse_qs(urlsplit(self.path).query)
            if "token" in query:
                return query["token"][0]
            auth = self.headers.get("Authorization", "")
            if auth.startswith("Bearer "):
                return auth[len("Bearer "):].strip()
            jar = cookies.SimpleCookie()
            try:
                jar.load(self.headers.get("Cookie", ""))
            except cookies.CookieError:
                return None
            return jar[COOKIE].value if COOKIE in jar else None

        def _send(self, status: int, body: bytes, content_type: str, headers: dict | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Security-Policy", "default-src 'self'; img-src 'self' data:")
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _text(self, status: int, text: str) -> None:
            self._send(status, (text + "\n").encode(), "text/plain; charset=utf-8")

        def do_HEAD(self) -> None:  # noqa: N802 (http.server's naming)
            self.do_GET()

        def do_GET(self) -> None:  # noqa: N802
            try:
                self._route()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the browser went away
            except Exception:  # noqa: BLE001 (a bug must not end the server: log it, answer 500)
                logger.exception("[Dashboard] %s failed", urlsplit(self.path).path)
                self._text(500, "internal error (see the coordinator's log)")

        def _route(self) -> None:
            path = urlsplit(self.path).path
            presented = self._token()
            if not server.allows(presented):
                self._text(401, "unauthorized: open the URL with ?token=... that the coordinator printed")
                return
            if path == "/":
                if "token" in parse_qs(urlsplit(self.path).query):  # keep the token out of the address bar
                    cookie = f"{COOKIE}={server.token}; Path=/; HttpOnly; SameSite=Strict"
                    if server.scheme == "https":
                        cookie += "; Secure"
                    self._send(303, b"", "text/plain", {"Location": "/", "Set-Cookie": cookie})
                    return
                self._static("index.html")
            elif path.startswith("/static/"):
                self._static(path[len("/static/"):])
            elif path == "/api/state":
                self._send(200, server.shared()[1].encode(), "application/json")
            elif path == "/metrics":
                # prometheus_client comes with the gateway's extra: imported on the first scrape
                from coordinator.dashboard.prometheus import exposition

                self._send(200, exposition(server.snapshot), "text/plain; version=0.0.4; charset=utf-8")
            elif path == "/events":
                self._events()
            else:
                self._text(404, f"no such page: {path}")

        def _static(self, name: str) -> None:
            if "/" in name or name.startswith(".") or Path(name).suffix not in STATIC_TYPES:
                self._text(404, f"no such file: {name}")
                return
            asset = resources.files("coordinator.dashboard").joinpath("static", name)
            if not asset.is_file():
                self._text(404, f"no such file: {name}")
                return
            self._send(200, asset.read_bytes(), STATIC_TYPES[Path(name).suffix])

        def _events(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-store")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            sent = None
            while not server.closed.is_set():
                data = server.shared()[1]
                if data != sent:
                    self.wfile.write(f"data: {data}\n\n".encode())
                    self.wfile.flush()
                    sent = data
                else:
                    self.wfile.write(b": still here\n\n")  # a comment line: finds a browser that left
                    self.wfile.flush()
                server.closed.wait(EVENT_INTERVAL_S)

    return Handler

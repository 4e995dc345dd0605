"""GET / and /ui/static/*: the page's files, read once, served with strict headers.

The page and its files are open without an API key (they hold no data: the page asks
for a key and sends it with each data request); the Host check and CORS apply to them
as to every route. Only the files shipped in `static/` are served, by exact name.
"""

from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from server.errors import ApiError
from server.ui.status import status_endpoint

STATIC_PREFIX = "/ui/static/"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
    ".txt": "text/plain; charset=utf-8",
}
# No inline script or style, nothing from another origin, no framing, no forms.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}


def load_static() -> dict[str, tuple[bytes, str]]:
    """name -> (bytes, content type) for every file shipped in server/ui/static."""
    files = {}
    for entry in resources.files("server.ui").joinpath("static").iterdir():
        suffix = entry.name[entry.name.rfind(".") :]
        if entry.is_file() and suffix in CONTENT_TYPES:
            files[entry.name] = (entry.read_bytes(), CONTENT_TYPES[suffix])
    return files


def file_response(files: dict[str, tuple[bytes, str]], name: str) -> Response:
    if name not in files:
        raise ApiError(404, "Not Found", "not_found_error")
    body, content_type = files[name]
    return Response(body, media_type=content_type, headers=SECURITY_HEADERS)


def ui_routes(device: str) -> list[Route]:
    """The page, its files and its data endpoint."""
    files = load_static()

    async def index(request: Request) -> Response:
        return file_response(files, "index.html")

    async def static(request: Request) -> Response:
        return file_response(files, request.path_params["name"])

    return [
        Route("/", index, methods=["GET"]),
        Route(STATIC_PREFIX + "{name}", static, methods=["GET"]),
        Route("/ui/status", status_endpoint(device), methods=["GET"]),
    ]

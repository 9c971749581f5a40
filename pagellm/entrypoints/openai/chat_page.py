"""GET /: the chat page (`static/chat.html`), a browser's way to try the served model.

The page is public (it holds no data; the API it calls asks for the key) and is one file with
its CSS and script inline. Its Content-Security-Policy lets it load nothing from anywhere and
talk only to this server, and runs only the page's own script (by its hash): a reply rendered
by mistake as HTML could run nothing.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter()

_SCRIPT = re.compile(rb"<script>(.*?)</script>", re.S)


@functools.cache
def _page() -> tuple[bytes, dict[str, str]]:
    """The page and its headers, read once from the package."""
    html = resources.files(__package__).joinpath("static/chat.html").read_bytes()
    hashes = " ".join(
        f"'sha256-{base64.b64encode(hashlib.sha256(s).digest()).decode()}'"
        for s in _SCRIPT.findall(html)
    )
    policy = (
        f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )
    headers = {
        "Content-Security-Policy": policy,
        "Cache-Control": "no-cache",  # a new server version's page, not the browser's old copy
        "X-Content-Type-Options": "nosniff",
    }
    return html, headers


@router.get("/", include_in_schema=False, response_class=HTMLResponse)
async def chat_page() -> HTMLResponse:
    html, headers = _page()
    return HTMLResponse(html, headers=headers)

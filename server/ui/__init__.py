"""The web page at `/`: a live view of the server and a chat that shows speculation.

Static files in `static/` (no build step, nothing fetched from elsewhere), served with a
strict Content-Security-Policy; the page reads GET /ui/status and streams chats through
/v1/chat/completions like any client, with the caller's API key when the server has keys.
"""

from __future__ import annotations

from server.ui.page import ui_routes

__all__ = ["ui_routes"]

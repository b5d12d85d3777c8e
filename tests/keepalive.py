"""A client's view of a server's idle keep-alive connections (the worker's and the control
plane's HTTP servers)."""

from __future__ import annotations

import http.client
import time
from urllib.parse import urlsplit


def answers_on_an_idle_connection(url: str, path: str, idle_s: float) -> bool:
    """Whether a connection that asked ``path`` and then sat idle ``idle_s`` seconds gets
    its next answer on the same socket (a server that closed it fails the request sent on
    it: ``http.client`` does not reconnect on its own)."""
    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname or "", where.port, timeout=30)
    try:
        conn.request("GET", path)
        first = conn.getresponse()
        first.read()
        sock = conn.sock
        time.sleep(idle_s)
        try:
            conn.request("GET", path)
            again = conn.getresponse()
            again.read()
        except (ConnectionError, http.client.HTTPException):
            return False
        return first.status == again.status == 200 and conn.sock is sock
    finally:
        conn.close()

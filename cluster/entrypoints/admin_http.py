"""What ``scale`` and ``rollout`` share: reaching a server's HTTP admin routes (urllib only: light commands)."""
from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import urllib.error
import urllib.request


def add_admin_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", default="localhost:8000", help="HOST:PORT of the server's HTTP API")
    p.add_argument("--drain-timeout", type=float, default=None,
                   help="seconds a removed replica's requests get to finish before they move (default: the "
                        "server's --drain-timeout)")
    p.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"))
    p.add_argument("--tls", action="store_true")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the change to finish")


def post(ns: argparse.Namespace, path: str, body: dict) -> int:
    """POST ``body`` (plus the drain timeout, if given) and print the server's message; the exit code."""
    if ns.drain_timeout is not None:
        body = {**body, "drain_timeout": ns.drain_timeout}
    headers = {"Content-Type": "application/json"}
    if ns.api_key:
        headers["Authorization"] = f"Bearer {ns.api_key}"
    url = f"{'https' if ns.tls else 'http'}://{ns.server}{path}"
    req = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=ns.timeout, context=ssl.create_default_context()) as resp:
            print(json.loads(resp.read())["message"])
        return 0
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        print(f"error: HTTP {e.code}: {message}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, TimeoutError) as e:
        print(f"error: {url}: {getattr(e, 'reason', e)}", file=sys.stderr)
        return 1

"""`specdec certs`: a development CA with server and client certificates (mutual TLS)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="directory to write ca.pem, server.pem/.key, client.pem/.key")
    parser.add_argument("--host", action="append", default=[],
                       help="a DNS name or IP the server certificate must cover (repeatable); "
                            "localhost and 127.0.0.1 are always included")


async def run(args) -> int:
    from specdec.security.tls import make_dev_certs

    written = make_dev_certs(Path(args.out), args.host)
    for stem, path in written.items():
        print(f"{stem:7s} {path}  (key: {path.with_suffix('.key')})" if stem != "ca" else f"ca      {path}")
    return 0

"""`python -m hotswap.fleet --urls URL URL [--port 31000]`: the Router's HTTP front."""

from __future__ import annotations

import argparse
import logging
import os

from hotswap.fleet.router import Router
from hotswap.fleet.router_app import create_router_app

logger = logging.getLogger("hotswap.router")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hotswap.fleet",
                                description="Route requests over several hotswap servers.")
    p.add_argument("--urls", nargs="+", required=True, help="the servers' base URLs")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=31000)
    p.add_argument("--api-key", default=None, help="the servers' API key (or HOTSWAP_API_KEY)")
    p.add_argument("--admin-key", default=None,
                   help="the servers' admin key (or HOTSWAP_ADMIN_KEY)")
    p.add_argument("--cache-threshold", type=float, default=0.5)
    p.add_argument("--balance-abs", type=int, default=16)
    p.add_argument("--balance-rel", type=float, default=2.0)
    p.add_argument("--log-level", default="info")
    return p


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    router = Router(args.urls, args.api_key or os.environ.get("HOTSWAP_API_KEY") or None,
                    args.admin_key or os.environ.get("HOTSWAP_ADMIN_KEY") or None,
                    cache_threshold=args.cache_threshold, balance_abs=args.balance_abs,
                    balance_rel=args.balance_rel)
    logger.info("routing over %s on http://%s:%d", ", ".join(router.urls), args.host, args.port)
    with router:
        uvicorn.run(create_router_app(router), host=args.host, port=args.port,
                    log_level=args.log_level)


if __name__ == "__main__":
    main()

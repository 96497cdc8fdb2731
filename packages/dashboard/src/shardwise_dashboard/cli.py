"""`shardwise-dashboard serve`: run the dashboard under uvicorn.

    shardwise-dashboard serve [--host 127.0.0.1] [--port 8265] [--db PATH] [--token T]
        [--stale-after S] [--retain-days D] [--max-db-mb M] [--thin-after-minutes M]

Listening on anything but a loopback address is refused without a token: ingestion would
otherwise accept events from anyone who can reach the port. The port is bound before the URL is
announced: without --port, a taken 8265 moves it to the next free port (said in the
announcement); a --port that is taken stops it with one line (exit status 1).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from pathlib import Path

DEFAULT_PORT = 8265


def default_db_path() -> Path:
    """$XDG_DATA_HOME/shardwise/dashboard.sqlite (~/.local/share/... when unset)."""
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "shardwise" / "dashboard.sqlite"


def is_loopback(host: str) -> bool:
    """Whether `host` names only this machine (a hostname other than localhost does not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardwise-dashboard", description="Live dashboard of shardwise training runs."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the dashboard and its ingestion endpoint")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument(
        "--port",
        type=int,
        default=None,
        help=f"port to bind (default {DEFAULT_PORT}, or the next free one when it is taken)",
    )
    serve.add_argument(
        "--db", type=Path, default=None, help=f"SQLite file of run history ({default_db_path()})"
    )
    serve.add_argument(
        "--token",
        default=os.environ.get("SHARDWISE_DASHBOARD_TOKEN"),
        help="bearer token ingestion must present (default: $SHARDWISE_DASHBOARD_TOKEN); "
        "required to bind a non-loopback address",
    )
    serve.add_argument(
        "--max-body-bytes", type=int, default=None, help="largest request accepted (8 MiB)"
    )
    serve.add_argument(
        "--stale-after",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="a run or rank not finished and silent this long shows as stale (%(default)s)",
    )
    serve.add_argument(
        "--retain-days",
        type=float,
        default=30.0,
        metavar="DAYS",
        help="delete runs silent for longer (%(default)s; 0 keeps every run)",
    )
    serve.add_argument(
        "--max-db-mb",
        type=float,
        default=4096.0,
        metavar="MB",
        help="delete the oldest runs while the database uses more (%(default)s; 0: no cap)",
    )
    serve.add_argument(
        "--thin-after-minutes",
        type=float,
        default=60.0,
        metavar="MINUTES",
        help="keep every 10th step (and every overflow) of older history (%(default)s; "
        "0 keeps every step)",
    )
    serve.add_argument(
        "--log-level", default="warning", choices=["debug", "info", "warning", "error"]
    )
    return parser


def _positive_or_none(value: float) -> float | None:
    # 0 on the command line means "no limit".
    return None if value == 0 else value


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and serve until interrupted."""
    parser = build_parser()
    args = parser.parse_args(argv)
    fallback = args.port is None  # the default port may move; one the user named may not
    port = DEFAULT_PORT if fallback else args.port
    if not 1 <= port <= 65535:
        parser.error(f"--port must be in 1..65535, got {port}")
    if not args.token and not is_loopback(args.host):
        parser.error(
            f"refusing to listen on {args.host} without a token: anyone who reaches it could "
            "write runs. Pass --token T (ranks send it from SHARDWISE_DASHBOARD_TOKEN) or bind "
            "a loopback address such as 127.0.0.1"
        )
    # Imported here so that --help and argument errors answer at once.
    import uvicorn

    from shardwise_dashboard import listen
    from shardwise_dashboard.app import create_app
    from shardwise_dashboard.settings import DEFAULT_MAX_BODY_BYTES, Settings
    from shardwise_dashboard.storage import StoreError

    max_db_mb = _positive_or_none(args.max_db_mb)
    thin_after = _positive_or_none(args.thin_after_minutes)
    try:
        settings = Settings(
            db_path=args.db or default_db_path(),
            token=args.token or None,
            max_body_bytes=args.max_body_bytes or DEFAULT_MAX_BODY_BYTES,
            stale_after_s=args.stale_after,
            retain_days=_positive_or_none(args.retain_days),
            max_db_bytes=None if max_db_mb is None else int(max_db_mb * 2**20),
            thin_after_s=None if thin_after is None else thin_after * 60,
        )
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    try:
        app = create_app(settings)
        # Bound before anything is announced: the URL printed is one this process listens on.
        sock = listen.bind(args.host, port, fallback=fallback)
    except (StoreError, OSError) as error:
        # One line that names the file or port and the fix: no traceback, no usage text.
        reason = error if isinstance(error, StoreError | listen.PortBusy) else _cannot_bind(error)
        print(f"shardwise-dashboard: error: {reason}", file=sys.stderr)
        raise SystemExit(1) from None
    bound = sock.getsockname()[1]
    shown = f"[{args.host}]" if ":" in args.host else args.host
    moved = f" (port {port} is in use)" if bound != port else ""
    print(
        f"shardwise dashboard on http://{shown}:{bound}{moved} (history in {settings.db_path})",
        flush=True,
    )
    if moved:
        print(f"  stream to it with SHARDWISE_DASHBOARD_URL=http://{shown}:{bound}", flush=True)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=bound,
        log_level=args.log_level,
        access_log=False,  # ranks post several times a second each
        timeout_graceful_shutdown=2,  # live streams never end on their own
    )
    uvicorn.Server(config).run(sockets=[sock])


def _cannot_bind(error: OSError) -> str:
    return f"cannot listen there: {error.strerror or error} (check --host)"

"""Run `redis-server` with a password that never appears on a command line.

`python -m plugsearch.common.redis_server --port P [--bind HOST] [--redis-server PATH]` reads the password from
`PLUGSEARCH_REDIS_PASSWORD` (an environment variable: readable only by the same user, unlike a process's
arguments, which every local user can list), writes `requirepass` into a pipe, and replaces itself with
`redis-server -` reading that configuration from its standard input. The process id stays the same, so a
supervisor (or a fault test) that signals it signals Redis. Without the variable Redis starts without a
password. The other options are the local stack's: no persistence, protected mode, loopback unless told, and a
memory cap (`--maxmemory`, default 512mb) past which the least recently used entries are evicted: every
key here is a cache entry, and without a cap a long-running stack's Redis grows with every distinct search.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from plugsearch.common.procgroup import ProcessSpec

PASSWORD_ENV = "PLUGSEARCH_REDIS_PASSWORD"  # noqa: S105 - the variable's name, not a password


def redis_url(host: str, port: int, password: str | None) -> str:
    """`redis://[:password@]host:port`, a database number to append (the password is hex from
    `secrets.token_hex`: no escaping needed)."""
    auth = f":{password}@" if password else ""
    return f"redis://{auth}{host}:{port}"


def redis_spec(port: int, password: str, *, redis_server: str | None = None) -> ProcessSpec:
    """Redis on a loopback port, started through this module with `password` (given through the environment),
    ready when it answers PING after AUTH."""
    argv = [sys.executable, "-m", "plugsearch.common.redis_server", "--port", str(port), "--bind", "127.0.0.1"]
    if redis_server:
        argv += ["--redis-server", redis_server]
    return ProcessSpec("redis", argv, env={PASSWORD_ENV: password}, port=port, ready_secret=password)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bind", default="127.0.0.1")
    parser.add_argument("--redis-server", default=None, help="the redis-server executable (default: on PATH)")
    parser.add_argument("--maxmemory", default="512mb", help="memory cap; least recently used keys are evicted")
    args = parser.parse_args(argv)
    exe = args.redis_server or shutil.which("redis-server")
    if exe is None:
        parser.error("redis-server not found on PATH")
    password = os.environ.pop(PASSWORD_ENV, "")
    config = f"requirepass {password}\n" if password else ""
    read_end, write_end = os.pipe()
    os.write(write_end, config.encode())  # a few bytes: far below the pipe's buffer
    os.close(write_end)
    os.dup2(read_end, 0)
    os.close(read_end)
    redis_args = [exe, "--port", str(args.port), "--bind", args.bind, "--save", "", "--appendonly", "no",
                  "--daemonize", "no", "--protected-mode", "yes", "--maxmemory", args.maxmemory,
                  "--maxmemory-policy", "allkeys-lru", "-"]
    os.execv(exe, redis_args)  # noqa: S606 - the configured or found redis-server, fixed options


if __name__ == "__main__":
    main()

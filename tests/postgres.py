"""A throwaway PostgreSQL server for tests: ``initdb`` + ``pg_ctl`` in a temp dir on a free localhost port.

Skipped with the reason when the server binaries (Debian: ``apt-get install -y postgresql``) or the driver
(``pip install psycopg2-binary``) are missing. As root (CI), the server runs as the ``postgres`` system user, since
``initdb`` refuses to run as root.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest


def _binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))  # Debian keeps them off PATH
    return candidates[-1] if candidates else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def postgres_url():
    """``postgresql://postgres@127.0.0.1:<port>/postgres`` of a fresh server, stopped and deleted afterwards."""
    initdb, pg_ctl = _binary("initdb"), _binary("pg_ctl")
    if not initdb or not pg_ctl:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) not found: apt-get install -y postgresql")
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        pytest.skip("the PostgreSQL driver is missing: pip install psycopg2-binary")
    root = Path(tempfile.mkdtemp(prefix="toolkit-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        import pwd

        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            shutil.rmtree(root, ignore_errors=True)
            pytest.skip("running as root and there is no 'postgres' user to run initdb as")
        runuser = shutil.which("runuser")
        if runuser is None:
            shutil.rmtree(root, ignore_errors=True)
            pytest.skip("running as root and 'runuser' (util-linux) is missing")
        os.chown(root, user.pw_uid, user.pw_gid)
        as_user = [runuser, "-u", "postgres", "--"]
    data, port = root / "data", _free_port()

    def run(*args: str) -> None:
        done = subprocess.run(as_user + list(args), capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            log = (root / "server.log").read_text() if (root / "server.log").exists() else ""
            raise RuntimeError(f"{args[0]} failed ({done.returncode}): {done.stderr}{done.stdout}{log}")

    try:
        run(initdb, "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        run(pg_ctl, "-D", str(data), "-l", str(root / "server.log"), "-w", "-t", "60",
            "-o", f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(as_user + [pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop"], capture_output=True,
                       timeout=120)
        shutil.rmtree(root, ignore_errors=True)

"""Where a study lives: its storage (a local SQLite file with one writer, or a shared RDB URL with heartbeats), the
lock on a run's output directory, and storage URLs without their password (never in logs, files or process
arguments)."""

from __future__ import annotations

import warnings
from pathlib import Path

from toolkit.errors import ConfigError


def safe_url(url: str) -> str:
    """A storage URL without its password."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        cred, host = rest.rsplit("@", 1)
        return f"{scheme}://{cred.split(':', 1)[0]}:***@{host}"
    return url


def driver_url(url: str) -> str:
    """``postgresql://`` with the driver that is installed: SQLAlchemy 2.1 defaults to psycopg 3, the toolkit
    depends on psycopg2 (``psycopg2-binary``)."""
    if url.startswith(("postgresql://", "postgres://")):
        import importlib.util

        if importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2") is not None:
            return "postgresql+psycopg2://" + url.split("://", 1)[1]
    return url


def open_storage(url: str | None, out_dir: Path, heartbeat_s: float | None):
    """``(RDBStorage, url, shared)``: the default is a local SQLite file (one writer); a given URL is shared by
    workers, so it runs with heartbeats and re-queues the trial of a dead worker once."""
    import optuna
    from optuna.storages import RetryFailedTrialCallback

    if url is None:
        url = f"sqlite:///{(out_dir / 'study.db').resolve()}"
        return optuna.storages.RDBStorage(url), url, False
    hb = heartbeat_s or 30.0
    try:
        with warnings.catch_warnings():  # the heartbeat callback is "experimental" since optuna 2.8
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            storage = optuna.storages.RDBStorage(driver_url(url), heartbeat_interval=max(1, int(round(hb))),
                                                 grace_period=int(3 * hb) + 1,
                                                 failed_trial_callback=RetryFailedTrialCallback(max_retry=1))
    except Exception as exc:  # noqa: BLE001 - a bad URL, a server that is down, a wrong password: the user's to fix
        detail = (str(exc).splitlines() or [""])[0]
        for secret in {url, driver_url(url)}:
            detail = detail.replace(secret, safe_url(secret))
        if "@" in url and "://" in url:  # a password may appear on its own, too
            password = url.split("://", 1)[1].rsplit("@", 1)[0].partition(":")[2]
            if password:
                detail = detail.replace(password, "***")
        raise ConfigError("--storage", f"cannot open the study storage {safe_url(url)} ({exc.__class__.__name__}: "
                          f"{detail})") from None
    return storage, url, True


def lock_out_dir(out_dir: Path):
    """An exclusive lock on ``out_dir`` for this run (released when the process ends).

    Raises:
        ConfigError: another process holds it (field ``out``).
    """
    from filelock import FileLock, Timeout

    lock = FileLock(str(out_dir / ".search.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise ConfigError("out", f"another search is running on {out_dir} (it holds {out_dir / '.search.lock'}); "
                          "wait for it, or use another --out") from None
    return lock

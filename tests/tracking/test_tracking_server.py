"""`worldpipe tracking server`: local by default, a database backend with its driver, clear errors."""

import subprocess
import sys
from pathlib import Path

import pytest

from worldpipe.tracking.server import LOCAL_HOST, ServerConfigError, check_backend, server_command

BIN = Path(sys.executable).parent


def test_the_server_binds_localhost_unless_told_otherwise(tmp_path):
    command = server_command("postgresql://u:p@db:5432/mlflow", str(tmp_path / "artifacts"))
    assert command[command.index("--host") + 1] == LOCAL_HOST
    assert command[command.index("--backend-store-uri") + 1] == "postgresql://u:p@db:5432/mlflow"
    assert command[command.index("--artifacts-destination") + 1] == str((tmp_path / "artifacts").resolve())
    opened = server_command("sqlite:///x.db", str(tmp_path / "a"), host="0.0.0.0", port=5001)
    assert opened[opened.index("--host") + 1] == "0.0.0.0" and opened[opened.index("--port") + 1] == "5001"


@pytest.mark.parametrize("uri", ["results/mlflow.db", "http://127.0.0.1:5000", "file:///tmp/mlruns"])
def test_a_backend_that_is_not_a_database_is_refused(uri):
    with pytest.raises(ServerConfigError, match="--backend-store-uri"):
        check_backend(uri)


def test_the_postgresql_driver_is_installed():
    check_backend("postgresql://user@127.0.0.1:5432/mlflow")


def test_cli_prints_the_command_and_rejects_bad_options_in_one_line(tmp_path):
    ok = subprocess.run([str(BIN / "worldpipe"), "tracking", "server", "--print-command", "--artifacts-destination",
                         str(tmp_path / "art"), "--", "--gunicorn-opts", "--timeout=60"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "--host 127.0.0.1" in ok.stdout and ok.stdout.rstrip().endswith("--gunicorn-opts --timeout=60")
    bad = subprocess.run([str(BIN / "worldpipe"), "tracking", "server", "--backend-store-uri", "results/x.db"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--backend-store-uri" in bad.stderr

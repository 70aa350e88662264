"""Case 9 of issue 9: records spooled while the tracking server is down reach it when it comes back during
the run, delivered by the recorder's own retries (no `worldpipe tracking sync`). A real `mlflow server` on
127.0.0.1, stopped with SIGKILL and restarted on the same port, by PID."""

from __future__ import annotations

import logging
import time

import pytest

from worldpipe.tracking.delivery import RETRY_FIRST_S, retry_delay
from worldpipe.tracking.recorder import RunRecorder

pytestmark = pytest.mark.adversarial


def test_retry_delay_backs_off_exponentially_up_to_the_cap():
    delays = [retry_delay(n, RETRY_FIRST_S, 30.0) for n in range(1, 10)]
    assert delays[0] == RETRY_FIRST_S
    assert all(b == min(30.0, 2 * a) for a, b in zip(delays, delays[1:], strict=False))
    assert delays[-1] == 30.0


@pytest.mark.integration
@pytest.mark.slow
def test_records_reach_a_server_that_comes_back_mid_run(tmp_path, caplog):
    from mlflow.tracking import MlflowClient

    from mlflow_support import MlflowServer

    server = MlflowServer(tmp_path / "server").start()
    recorder = RunRecorder(True, server.url, "adversarial-retry", run_dir=tmp_path / "run")
    try:
        recorder.start(None, "retry", tags={"worldpipe.test": "retry"})
        run_id = recorder.await_run_id()
        assert run_id is not None
        server.kill()
        with caplog.at_level(logging.WARNING, logger="worldpipe.tracking"):
            recorder.add_metrics(5, {"loss/total": 0.25}, 1_000)
            recorder.stage(5)
            recorder.commit(5, tags={"worldpipe.checkpoint_step": "5"})
            deadline = time.monotonic() + 120
            while not any("unreachable" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "the courier never tried the dead server"
                time.sleep(0.05)
        assert recorder.spool.pending(), "records must wait in the spool while the server is down"

        server.start()  # same port; the run goes on, nobody runs `worldpipe tracking sync`
        deadline = time.monotonic() + 180
        while recorder.spool.pending():
            assert time.monotonic() < deadline, "records were not delivered after the server came back"
            time.sleep(0.1)
        client = MlflowClient(server.url)
        assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss/total")] == [(5, 0.25)]
        assert client.get_run(run_id).data.tags["worldpipe.checkpoint_step"] == "5"
    finally:
        recorder.end()
        server.kill()

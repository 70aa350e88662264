"""Case 5 of issue 9, the console side: torchrun's stderr relayed so a failure is one line (the real streams
are exercised end to end in test_launcher.py; here every rule of the relay, on recorded shapes of output)."""

from __future__ import annotations

import io

import pytest

from worldpipe.launch.relay import OutputRelay

pytestmark = pytest.mark.adversarial

TORCHRUN_FAILURE = b"""W1129 18:45:34.329000 21982 torch/distributed/elastic/multiprocessing/api.py:900] Sending process 22001 closing signal SIGTERM
E1129 18:45:34.400000 21982 torch/distributed/elastic/multiprocessing/api.py:874] failed (exitcode: 1) local_rank: 0 (pid: 22000) of binary: /x/python3
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
worldpipe.launch.worker FAILED
"""


def relay_of(*chunks: bytes, tmp_path) -> tuple[OutputRelay, str]:
    out = io.StringIO()
    relay = OutputRelay(out, tmp_path / "errors.log")
    for chunk in chunks:
        relay.feed(chunk)
    relay.close()
    return relay, out.getvalue()


def test_one_primary_line_and_nothing_of_torchruns_report(tmp_path):
    relay, shown = relay_of(b"INFO worldpipe.trainer.main: step 10\n",
                            b"error (secondary): [../gloo/transport/tcp/pair.cc:534] Connection closed by peer\n",
                            b"error: corrupt dataset file 'obs/c/5/0/0': sha256 does not match the manifest\n",
                            b"error: corrupt dataset file 'obs/c/4/0/0': sha256 does not match the manifest\n",
                            TORCHRUN_FAILURE, tmp_path=tmp_path)
    assert shown.splitlines() == ["INFO worldpipe.trainer.main: step 10",
                                  "error: corrupt dataset file 'obs/c/5/0/0': sha256 does not match the manifest"]
    assert relay.summary(1) is None and relay.child_exit == 1
    relay.write_log()
    log = (tmp_path / "errors.log").read_text()
    assert "ChildFailedError" in log and "Connection closed by peer" in log and "obs/c/4/0/0" in log


def test_a_secondary_error_is_shown_only_without_a_primary_one(tmp_path):
    relay, shown = relay_of(b"error (secondary): Connection closed by peer\n", TORCHRUN_FAILURE, tmp_path=tmp_path)
    assert shown == ""
    assert relay.summary(1) == "error: Connection closed by peer"


def test_a_silent_death_is_summarised_with_the_log_file(tmp_path):
    relay, shown = relay_of(TORCHRUN_FAILURE, tmp_path=tmp_path)
    assert shown == ""
    line = relay.summary(1)
    assert line.startswith("error: training failed (torchrun exit status 1)") and str(tmp_path / "errors.log") in line


def test_progress_bars_and_split_chunks_pass_through(tmp_path):
    relay, shown = relay_of(b"train:  10%|#  | 1/10\r", b"train:  20%|##", b" | 2/10\r", b"done\n",
                            tmp_path=tmp_path)
    assert shown == "train:  10%|#  | 1/10\rtrain:  20%|## | 2/10\rdone\n"
    assert relay.summary(0) is None


def test_debug_shows_everything(tmp_path):
    out = io.StringIO()
    relay = OutputRelay(out, tmp_path / "errors.log", debug=True)
    relay.feed(TORCHRUN_FAILURE)
    relay.close()
    assert "ChildFailedError" in out.getvalue() and relay.summary(1) is None


def test_an_error_after_an_unterminated_progress_bar_is_still_its_own_line(tmp_path):
    # What a rank-0 worker writes: a bar redrawn with a leading '\r' and never ended, then its error line
    # (started with '\r' by errors.report), then another rank's secondary error.
    relay, shown = relay_of(b"\rtrain:   0%|   | 0/20", b"\rtrain:  50%|#  | 10/20",
                            b"\rerror: saving checkpoint step 10 failed at /r/model.pt: [Errno 5] EIO\n",
                            b"\rerror (secondary): Connection closed by peer\n", TORCHRUN_FAILURE, tmp_path=tmp_path)
    lines = shown.splitlines()
    assert lines[-1] == "error: saving checkpoint step 10 failed at /r/model.pt: [Errno 5] EIO"
    assert [line for line in lines if "error" in line] == [lines[-1]]
    assert relay.summary(1) is None and relay.at_line_start

"""Screenshot the MLflow UI's run list of an experiment with headless Chromium (Debian's `chromium`).

    python workflow/scripts/screenshot_mlflow_ui.py                      # results/mlflow.db -> results/mlflow_ui.png
    python workflow/scripts/screenshot_mlflow_ui.py --tracking-uri http://127.0.0.1:5000 --out /tmp/ui.png
    python workflow/scripts/screenshot_mlflow_ui.py --compare RUN_A RUN_B --expect eval/one_step_ratio  # compare view
    python workflow/scripts/screenshot_mlflow_ui.py --page run:RUN_ID --page model:MODEL_ID --out results/ui/  # pages
    python workflow/scripts/screenshot_mlflow_ui.py --charts --expect control/score  # the runs' metrics charted

With a database URI (default: the embedded sqlite:///results/mlflow.db) a temporary `mlflow server` serves the
UI on a free local port. `--install` apt-installs chromium when it is missing (needs root). The page's DOM is
dumped too, and the run names of the experiment must appear in it: an empty or broken page is an error. Every
page opens in the UI's Model training view (the links worldpipe prints); `--page` screenshots each named page
(`run:ID`, `artifacts:ID/PATH`, `model:ID`) into the `--out` directory, each checked by `--expect`/`--refuse`.
Prints a JSON summary; exit 0 on success, 3 when Chromium is unavailable, 1 on any other failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from worldpipe.config.paths import default_tracking_uri
from worldpipe.tracking.links import experiment_url, model_url, run_url

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run", "--disable-sync", "--hide-scrollbars"]
EXIT_NO_CHROMIUM = 3
COMPARE_HEIGHT = 2400
CHARTS_BUDGET_MS = 90000


def find_chromium(install: bool) -> str | None:
    for name in ("chromium", "chromium-browser"):
        if shutil.which(name):
            return shutil.which(name)
    if install and os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], env=env, capture_output=True, timeout=1200)
        return shutil.which("chromium")
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_ui_server(backend_uri: str, workdir: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    mlflow = Path(sys.executable).parent / "mlflow"
    proc = subprocess.Popen(
        [str(mlflow if mlflow.exists() else "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", backend_uri, "--artifacts-destination", str(workdir / "artifacts")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError(f"mlflow server for {backend_uri} did not start")


def chromium(binary: str, url: str, profile: Path, *args: str, timeout: float = 120,
             height: int = 1000, budget_ms: int = 30000) -> subprocess.CompletedProcess:
    cmd = [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size=1600,{height}",
           f"--virtual-time-budget={budget_ms}", *args, url]
    return subprocess.run(cmd, capture_output=True, timeout=timeout)


def screenshot(url: str, experiment: str, out: Path, binary: str) -> dict:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=url)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise RuntimeError(f"no experiment {experiment!r} at {url}")
    runs = client.search_runs([exp.experiment_id], max_results=50)
    names = sorted({r.info.run_name for r in runs if r.info.run_name})
    page = experiment_url(url, exp.experiment_id)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="worldpipe-chromium-") as tmp:
        dom = chromium(binary, page, Path(tmp) / "profile-dom", "--dump-dom").stdout.decode(errors="replace")
        shot = chromium(binary, page, Path(tmp) / "profile-shot", f"--screenshot={out}")
    if shot.returncode != 0 or not out.exists():
        raise RuntimeError(f"chromium failed ({shot.returncode}): {shot.stderr.decode(errors='replace')[-1000:]}")
    shown = [name for name in names if f">{name}<" in dom]
    if names and not shown:
        raise RuntimeError(f"the UI at {page} shows none of the runs {names}")
    return {"page": page, "screenshot": str(out), "bytes": out.stat().st_size, "runs": len(runs), "shown": shown,
            "dom": dom}


def compare_page(url: str, run_ids: list[str]) -> tuple[str, list[str]]:
    """The UI's compare view of runs (their params and metrics side by side) and the run names it must show."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=url)
    runs = [client.get_run(run_id) for run_id in run_ids]
    experiments = sorted({r.info.experiment_id for r in runs})
    query = urllib.parse.urlencode({"runs": json.dumps(run_ids), "experiments": json.dumps(experiments)})
    return f"{url}/#/compare-runs?{query}", [r.info.run_name for r in runs]


def charts_page(url: str, experiment: str) -> str:
    """The experiment's chart view: a chart per metric, every run a series, grouped by the metric's prefix."""
    from mlflow.tracking import MlflowClient

    exp = MlflowClient(tracking_uri=url).get_experiment_by_name(experiment)
    if exp is None:
        raise RuntimeError(f"no experiment {experiment!r} at {url}")
    return f"{experiment_url(url, exp.experiment_id)}&compareRunsMode=CHART"


def screenshot_page(page: str, out: Path, binary: str, expect: list[str], height: int = 1000,
                    budget_ms: int = 30000) -> dict:
    """Screenshot any UI page; every expected text must be in its rendered DOM (``budget_ms``: Chromium's virtual
    time for the page to settle; the chart view draws its charts section by section, after its data)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="worldpipe-chromium-") as tmp:
        dom = chromium(binary, page, Path(tmp) / "profile-dom", "--dump-dom", height=height,
                       budget_ms=budget_ms).stdout.decode(errors="replace")
        shot = chromium(binary, page, Path(tmp) / "profile-shot", f"--screenshot={out}", height=height,
                        budget_ms=budget_ms)
    if shot.returncode != 0 or not out.exists():
        raise RuntimeError(f"chromium failed ({shot.returncode}): {shot.stderr.decode(errors='replace')[-1000:]}")
    missing = [text for text in expect if text not in dom]
    if missing:
        raise RuntimeError(f"the UI at {page} does not show {missing}")
    return {"page": page, "screenshot": str(out), "bytes": out.stat().st_size, "shown": expect}


def named_page(url: str, name: str) -> str:
    """The UI address of ``run:ID``, ``artifacts:ID/PATH`` (the file selected in the run's artifacts) or
    ``model:ID``, in the Model training view."""
    from mlflow.tracking import MlflowClient

    kind, _, ref = name.partition(":")
    client = MlflowClient(tracking_uri=url)
    if kind == "model":
        return model_url(url, client.get_logged_model(ref).experiment_id, ref)
    run_id, _, path = ref.partition("/")
    page = run_url(url, client.get_run(run_id).info.experiment_id, run_id)
    if kind == "artifacts":
        base, query = page.split("?", 1)
        return f"{base}/artifacts/{path}?{query}"
    if kind != "run":
        raise ValueError(f"--page {name}: expected run:ID, artifacts:ID/PATH or model:ID")
    return page


def screenshot_pages(url: str, names: list[str], out_dir: Path, binary: str, expect: list[str],
                     refuse: list[str]) -> dict:
    """One screenshot per named page (one Chromium run each: DOM and image), every one checked."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shots = []
    with tempfile.TemporaryDirectory(prefix="worldpipe-chromium-") as tmp:
        for index, name in enumerate(names):
            page = named_page(url, name)
            out = out_dir / f"{index:02d}-{name.partition(':')[0]}.png"
            done = chromium(binary, page, Path(tmp) / f"profile-{index}", "--dump-dom", f"--screenshot={out}")
            dom = done.stdout.decode(errors="replace")
            if done.returncode != 0 or not out.exists():
                raise RuntimeError(f"chromium failed on {page} ({done.returncode})")
            out.with_suffix(".html").write_text(dom)  # the rendered page, for checks beyond --expect
            missing = [text for text in expect if text not in dom]
            shown = [text for text in refuse if text in dom]
            if missing or shown:
                raise RuntimeError(f"the UI at {page} lacks {missing} or shows {shown}")
            shots.append({"page": page, "screenshot": str(out), "bytes": out.stat().st_size})
    return {"pages": shots}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tracking-uri", default=None,
                        help="http(s) URL of a running server, or a database URI (default sqlite:///results/mlflow.db)")
    parser.add_argument("--experiment", default="worldpipe")
    parser.add_argument("--out", default="results/mlflow_ui.png")
    parser.add_argument("--install", action="store_true", help="apt-get install chromium if missing (root)")
    parser.add_argument("--compare", nargs="+", metavar="RUN_ID",
                        help="screenshot the compare view of these runs instead of the run list")
    parser.add_argument("--expect", action="append", default=[],
                        help="text the page must show (repeatable; with --compare the run names are expected too)")
    parser.add_argument("--refuse", action="append", default=[], help="text the page(s) must not show (repeatable)")
    parser.add_argument("--charts", action="store_true",
                        help="screenshot the experiment's chart view (every metric charted across its runs)")
    parser.add_argument("--page", action="append", default=[], metavar="KIND:ID",
                        help="run:RUN_ID, artifacts:RUN_ID/PATH or model:MODEL_ID; --out is then a directory")
    args = parser.parse_args(argv)

    binary = find_chromium(args.install)
    if binary is None:
        print(json.dumps({"error": "chromium is not installed (apt-get install chromium, or pass --install)"}))
        return EXIT_NO_CHROMIUM
    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()
    server = None
    with tempfile.TemporaryDirectory(prefix="worldpipe-ui-") as tmp:
        try:
            if not uri.startswith(("http://", "https://")):
                server, url = start_ui_server(uri, Path(tmp))
            else:
                url = uri
            if args.page:
                summary = screenshot_pages(url, args.page, Path(args.out), binary, args.expect, args.refuse)
            elif args.charts:
                summary = screenshot_page(charts_page(url, args.experiment), Path(args.out), binary, args.expect,
                                          height=COMPARE_HEIGHT, budget_ms=CHARTS_BUDGET_MS)
            elif args.compare:
                page, names = compare_page(url, args.compare)
                # tall: the compare view lists the runs' params and metrics below its plots
                summary = screenshot_page(page, Path(args.out), binary, names + args.expect, height=COMPARE_HEIGHT)
            else:
                summary = screenshot(url, args.experiment, Path(args.out), binary)
                missing = [text for text in args.expect if text not in summary.get("dom", "")]
                shown = [text for text in args.refuse if text in summary.get("dom", "")]
                if missing or shown:
                    raise RuntimeError(f"the run list lacks {missing} or shows {shown}")
        except Exception as err:  # noqa: BLE001 - report any failure as JSON
            print(json.dumps({"error": f"{type(err).__name__}: {err}"}))
            return 1
        finally:
            if server is not None:
                os.killpg(server.pid, signal.SIGTERM)
                server.wait(timeout=30)
    summary.pop("dom", None)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: what an open dashboard costs the training it shows.

The demo job (MobileNetV2 on SYNTHETIC CIFAR-shaped data, four emulated boards at 0.5, 0.3, 0.2
and 0.1 of a core) runs with its dashboard served in every run, alternately with the page open
in headless Chromium (live updates every second) and with no page open: A B A B ... Throughput
is the median samples/s of the steps after `--warmup` in each run; the arms' medians over their
runs are compared.

    python scripts/bench_dashboard.py [--pairs 2] [--steps 40] [--warmup 8]

Needs Chromium and chromedriver from the distribution (Debian: apt-get install chromium
chromium-driver) and selenium (pip install '.[test]'). Last line: one JSON object with
`open_samples_per_s`, `closed_samples_per_s`, their `ratio`, and every run's figure.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO_JOB = REPO / "edgetrain" / "presets" / "demo.yaml"


def open_page(url: str, profile: Path):
    """Headless Chromium (the distribution's) showing `url`."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    driver.get(url)
    return driver


def run_once(workdir: Path, name: str, steps: int, warmup: int, with_page: bool) -> float:
    """One demo run; its steady-state samples/s."""
    runs = workdir / name
    proc = subprocess.Popen([sys.executable, "-m", "edgetrain", "local", str(DEMO_JOB), "--runs-dir", str(runs),
                             "--set", f"training.steps={steps}", "--set", "training.eval_every=0",
                             "--set", "training.checkpoint_every_s=0", "--dashboard", "127.0.0.1:0"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    driver = None
    try:
        url_file = runs / "demo" / "dashboard.url"
        while with_page and not (url_file.exists() and url_file.read_text().strip()):
            if proc.poll() is not None:
                raise RuntimeError(f"{name}: the run ended before its dashboard served")
            time.sleep(0.2)
        if with_page:
            driver = open_page(url_file.read_text().strip(), workdir / f"{name}-chromium")
        if proc.wait() != 0:
            raise RuntimeError(f"{name}: the run failed (exit {proc.returncode}); see {runs / 'demo' / 'logs'}")
    finally:
        if driver is not None:
            driver.quit()
        if proc.poll() is None:
            proc.kill()
    records = [json.loads(line) for line in (runs / "demo" / "metrics.jsonl").read_text().splitlines()]
    rates = [r["samples_per_s"] for r in records if r.get("kind") == "train" and r["step"] >= warmup]
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=2, help="A B pairs (open, closed)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8)
    args = parser.parse_args()
    if not (shutil.which("chromium") or shutil.which("chromium-browser")) or not shutil.which("chromedriver"):
        sys.exit("bench_dashboard needs Chromium and chromedriver (Debian: apt-get install chromium chromium-driver)")
    print("# demo job on 4 emulated boards; data: SYNTHETIC", flush=True)
    runs: dict[str, list[float]] = {"open": [], "closed": []}
    with tempfile.TemporaryDirectory(prefix="bench-dashboard-") as tmp:
        for i in range(args.pairs):
            for arm in ("open", "closed"):
                rate = run_once(Path(tmp), f"{arm}-{i}", args.steps, args.warmup, with_page=arm == "open")
                runs[arm].append(rate)
                print(f"{arm} page, run {i}: {rate:.2f} samples/s", flush=True)
    open_, closed = statistics.median(runs["open"]), statistics.median(runs["closed"])
    print(f"page open: {open_:.2f} samples/s (runs {runs['open']}); closed: {closed:.2f} (runs {runs['closed']}); "
          f"open/closed {open_ / closed:.3f}", flush=True)
    print(json.dumps({"synthetic_data": True, "open_samples_per_s": round(open_, 2),
                      "closed_samples_per_s": round(closed, 2), "ratio": round(open_ / closed, 4),
                      "runs": {k: [round(v, 2) for v in vs] for k, vs in runs.items()}}))


if __name__ == "__main__":
    main()

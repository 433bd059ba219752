"""Benchmark: what an open dashboard costs the training it shows.

The demo job (MobileNetV2 on SYNTHETIC CIFAR-shaped data, four emulated boards at 0.5, 0.3, 0.2
and 0.1 of a core), as proportional data parallelism (its planner off: plans must not change
between windows), runs with its dashboard served, and within the same run the page is open in
headless Chromium (live updates every second) and closed (the browser on about:blank) in
alternating windows of `--window` steps: A B A B ... Comparing windows of one run removes what
differs between runs (the boards' join-time profiles, and so their shares:
docs/benchmarks.md#comparing-arms). A window's figure is the median samples/s of its steps after the
first (which straddles the switch); the arms are compared by the median over windows and by the
median ratio of each open window to the closed window after it, with the spread of those ratios.
Each window also records the CPU the browser (all its processes) and the coordinator (which
serves the page) used, in cores: what the open page costs the gateway, measured directly.

    python scripts/bench_dashboard.py [--runs 1] [--steps 252] [--window 12] [--warmup 8] [--smoke] [--record]

Needs Chromium and chromedriver from the distribution (Debian: apt-get install chromium
chromium-driver) and selenium (pip install '.[test]'). Last line: one JSON object with
`open_samples_per_s`, `closed_samples_per_s`, their `ratio`, the pairs' `pair_ratio_median` and
`pair_ratio_quartiles`, and every window's figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from edgetrain.experiment.bench_output import add_bench_args, finish, stop_on_sigterm

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


def run_once(workdir: Path, name: str, steps: int, warmup: int, window: int,
             overrides: tuple[str, ...] = ()) -> list[dict]:
    """One demo run, its page opened and closed every `window` steps after `warmup`; its windows
    as {arm, steps, samples_per_s}."""
    runs = workdir / name
    proc = subprocess.Popen([sys.executable, "-m", "edgetrain", "local", str(DEMO_JOB), "--runs-dir", str(runs),
                             "--set", f"training.steps={steps}", "--set", "training.eval_every=0",
                             "--set", "training.checkpoint_every_s=0", "--set", "planner.enabled=false",
                             *(a for o in overrides for a in ("--set", o)),
                             "--dashboard", "127.0.0.1:0"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    driver = None
    metrics = runs / "demo" / "metrics.jsonl"
    switches: list[tuple[int, str]] = []  # (first step under it, arm)
    cpu: list[tuple[float, float, float]] = []  # at each switch: (time, browser CPU s, coordinator CPU s)
    try:
        url_file = runs / "demo" / "dashboard.url"
        while not (url_file.exists() and url_file.read_text().strip()):
            if proc.poll() is not None:
                raise RuntimeError(f"{name}: the run ended before its dashboard served")
            time.sleep(0.2)
        url = url_file.read_text().strip()
        driver = open_page("about:blank", workdir / f"{name}-chromium")
        browser = psutil.Process(driver.service.process.pid)
        coordinator = _coordinator_of(proc)
        arm = "closed"
        counter = StepCounter(metrics)
        next_switch = warmup  # a poll may see several steps at once: switch at the first count past it
        while proc.poll() is None:
            done = counter.done()
            if done >= next_switch:
                arm = "open" if arm == "closed" else "closed"
                driver.get(url if arm == "open" else "about:blank")
                switches.append((done, arm))
                cpu.append((time.monotonic(), _cpu_s(browser), _cpu_s(coordinator)))
                next_switch = done + window
            time.sleep(0.1)
        if proc.returncode != 0:
            raise RuntimeError(f"{name}: the run failed (exit {proc.returncode}); see {runs / 'demo' / 'logs'}")
    finally:
        if driver is not None:
            driver.quit()
        if proc.poll() is None:  # interrupted: `edgetrain local` stops its coordinator and boards on SIGTERM
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    rate = {r["step"]: r["samples_per_s"] for r in records if r.get("kind") == "train"}
    windows = []
    for i, ((first, arm), (end, _)) in enumerate(zip(switches, switches[1:])):
        inside = [rate[s] for s in range(first + 1, end) if s in rate]  # the first straddles the switch
        (t0, b0, c0), (t1, b1, c1) = cpu[i], cpu[i + 1]
        if len(inside) >= 2:
            windows.append({"arm": arm, "steps": [first, end], "samples_per_s": statistics.median(inside),
                            "browser_cores": (b1 - b0) / (t1 - t0), "coordinator_cores": (c1 - c0) / (t1 - t0)})
    return windows


def _coordinator_of(local: subprocess.Popen) -> psutil.Process | None:
    """The coordinator process `edgetrain local` started (it serves the dashboard)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for child in psutil.Process(local.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "coordinator" in child.cmdline():
                    return child
        time.sleep(0.2)
    return None


def _cpu_s(process: psutil.Process | None) -> float:
    """CPU seconds of `process` and its children so far (0 when it is gone)."""
    if process is None:
        return 0.0
    total = 0.0
    for p in [process, *process.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            times = p.cpu_times()
            total += times.user + times.system
    return total


class StepCounter:
    """Train records in a growing metrics.jsonl (reads only what was appended)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.count, self.tail = path, 0, 0, b""

    def done(self) -> int:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return 0
        self.offset += len(data)
        lines = (self.tail + data).split(b"\n")
        self.tail = lines.pop()
        self.count += sum(b'"kind": "train"' in line for line in lines)
        return self.count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="demo runs (each holds many A B pairs)")
    parser.add_argument("--steps", type=int, default=252)
    parser.add_argument("--window", type=int, default=12, help="steps per window (page open, then closed, ...)")
    parser.add_argument("--warmup", type=int, default=8)
    add_bench_args(parser)
    args = parser.parse_args()
    overrides: tuple[str, ...] = ()
    if args.smoke:  # four windows of four steps of a small model
        args.runs, args.steps, args.window, args.warmup = 1, 21, 4, 1
        overrides = ("model=small_cnn", "dataset.train_size=256", "dataset.test_size=32")
    stop_on_sigterm()
    if not (shutil.which("chromium") or shutil.which("chromium-browser")) or not shutil.which("chromedriver"):
        sys.exit("bench_dashboard needs Chromium and chromedriver (Debian: apt-get install chromium chromium-driver)")
    print("# demo job on 4 emulated boards; data: SYNTHETIC", flush=True)
    windows: list[dict] = []
    pairs: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-dashboard-") as tmp:
        for i in range(args.runs):
            these = run_once(Path(tmp), f"run-{i}", args.steps, args.warmup, args.window, overrides)
            for w in these:
                print(f"run {i}, steps {w['steps'][0]}-{w['steps'][1] - 1}: page {w['arm']}, "
                      f"{w['samples_per_s']:.2f} samples/s; browser {w['browser_cores']:.3f} cores, "
                      f"coordinator {w['coordinator_cores']:.3f}", flush=True)
            pairs += [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(these, these[1:])
                      if a["arm"] == "open" and b["arm"] == "closed"]
            windows += these
    by_arm = {arm: [w["samples_per_s"] for w in windows if w["arm"] == arm] for arm in ("open", "closed")}
    if not pairs or not all(by_arm.values()):
        sys.exit(f"bench_dashboard: no page-open window followed by a closed one in {args.steps} steps "
                 f"(windows: {[w['arm'] for w in windows]}); give it more --steps")
    cores = {f"{who}_cores_{arm}": round(statistics.median(w[f"{who}_cores"] for w in windows if w["arm"] == arm), 4)
             for who in ("browser", "coordinator") for arm in ("open", "closed")}
    open_, closed = statistics.median(by_arm["open"]), statistics.median(by_arm["closed"])
    quartiles = statistics.quantiles(pairs, n=4) if len(pairs) >= 2 else [pairs[0]] * 3
    print(f"CPU (cores, median window): browser {cores['browser_cores_open']} open / "
          f"{cores['browser_cores_closed']} on about:blank; coordinator {cores['coordinator_cores_open']} open / "
          f"{cores['coordinator_cores_closed']} closed", flush=True)
    print(f"page open: {open_:.2f} samples/s over {len(by_arm['open'])} windows; closed: {closed:.2f} over "
          f"{len(by_arm['closed'])}; open/closed {open_ / closed:.3f}; each open window over the closed one after "
          f"it: median {statistics.median(pairs):.3f}, quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f} "
          f"({len(pairs)} pairs)", flush=True)
    finish(__file__, {"synthetic_data": True, "open_samples_per_s": round(open_, 2),
                      "closed_samples_per_s": round(closed, 2), "ratio": round(open_ / closed, 4),
                      "pair_ratio_median": round(statistics.median(pairs), 4),
                      "pair_ratio_quartiles": [round(quartiles[0], 4), round(quartiles[2], 4)], "pairs": len(pairs),
                      **cores,
                      "windows": [{**w, "samples_per_s": round(w["samples_per_s"], 2),
                                   "browser_cores": round(w["browser_cores"], 4),
                                   "coordinator_cores": round(w["coordinator_cores"], 4)} for w in windows]}, args)


if __name__ == "__main__":
    main()

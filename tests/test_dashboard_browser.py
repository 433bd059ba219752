"""The dashboard in a real browser (headless Chromium from the distribution, driven by Selenium
through the system chromedriver) against a real coordinator training on real boards."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from conftest import read_metrics, small_job, wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install '.[test]')")
REQUIRED = os.environ.get("EDGETRAIN_REQUIRE_BROWSER") == "1"
"""Set by .ci/run once Chromium is installed: then a missing browser fails the test instead of skipping it."""
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER) and not REQUIRED,
    reason="no Chromium/chromedriver on this machine (Debian: apt-get install chromium chromium-driver; "
           ".ci/run installs them)")


@pytest.fixture
def browser(tmp_path: Path):
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=1280,900"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_page_shows_the_fleet_training_live_and_a_killed_board_as_lost(
        coordinator_factory, client_factory, browser, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    # Prepare: a real coordinator with its dashboard, three real boards, a few steps done; the equal
    # split puts every board in every step (the proportional one, with 8 samples a board, left one
    # out of every step for a minute on a machine loaded by a CPU hog)
    job = small_job(training={"steps": 400, "min_clients": 3, "global_batch": 24, "heartbeat_timeout_s": 3.0,
                              "split": "equal"})
    coordinator = coordinator_factory(job, dashboard="127.0.0.1:0")
    url = (coordinator.run_dir / "dashboard.url").read_text().strip()
    victim = client_factory(coordinator.address, "victim", 0.5)
    for name in ("a", "c"):
        client_factory(coordinator.address, name, 0.5)
    wait_for(lambda: len(read_metrics(coordinator.run_dir)) >= 2, 120, "two steps", interval_s=0.2)

    # read the page in one script call each: it redraws itself every second (elements found one
    # call and read the next may be gone)
    def rows() -> dict[str, str]:
        return dict(browser.execute_script(
            "return Array.from(document.querySelectorAll('#boards tbody tr'), r => [r.dataset.board, r.dataset.state])"))

    def loss_points() -> int:
        return int(browser.execute_script("return document.getElementById('loss').dataset.points") or 0)

    def plans() -> list[str]:
        return browser.execute_script(
            "return Array.from(document.querySelectorAll('#events li.plan'), li => li.textContent)")

    # Execute / Assert: the printed URL opens the page (the token moves to a cookie)
    browser.get(url)
    assert "token=" not in browser.current_url
    wait_for(lambda: set(rows()) == {"a", "c", "victim"}, 30, "every board on the page", interval_s=0.2)
    assert browser.find_element(By.ID, "synthetic").is_displayed()  # the data is synthetic: the page says so
    assert browser.find_element(By.ID, "job").text == job.name

    # the loss curve gains points as steps are applied (live, without reloading)
    seen = loss_points()
    wait_for(lambda: loss_points() > seen, 60, "the loss curve to gain points", interval_s=0.2)
    # the plan as a picture (three DP shards here), its step times, the energy curve and every
    # board's row in the step timeline
    # (the page draws the newest step's: wait for one drawn with all three)
    def drawing() -> dict:
        return browser.execute_script("""
        return {shards: Array.from(document.querySelectorAll('#plan .shard'), r => r.dataset.board).sort(),
                times: document.getElementById('plan-times').textContent,
                energy: Number(document.getElementById('energy').dataset.points || 0),
                timeline: Array.from(document.querySelectorAll('#timeline .bar'), r => r.dataset.board).sort()}""")

    drawn: dict = {}

    def all_three_drawn() -> bool:
        drawn.update(drawing())
        return drawn["shards"] == drawn["timeline"] == ["a", "c", "victim"]

    wait_for(all_three_drawn, 60, lambda: f"a plan and a timeline with all three boards (last drawn: {drawn})",
             interval_s=0.2)
    assert "predicted" in drawn["times"] and "measured" in drawn["times"], drawn
    assert drawn["energy"] > 0, drawn  # emulated boards report their energy: the curve has points

    # a board killed mid-run turns "lost" within a few seconds of its heartbeat timeout
    victim.kill()
    wait_for(lambda: rows().get("victim") == "lost", 30, "the killed board to show as lost", interval_s=0.2)
    # and the steps after it are planned without it: the re-plan is on the timeline, with why
    wait_for(lambda: any("without victim" in text for text in plans()), 60,
             "the re-plan without the killed board on the timeline", interval_s=0.2)
    browser.save_screenshot(str(tmp_path / "dashboard.png"))

    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == [], errors

"""A person's view: JupyterLab in Debian's chromium, driven by Playwright.

Opens notebooks/02_budget_slider.ipynb, runs all cells, types a new budget into the
slider, and checks that the plot changed and that the kernel saw the new budget.
The screenshot is written to out/browser/ (and its path printed when the test fails);
MAGIS_SCREENSHOT=PATH also copies it there (the README's picture:
docs/notebook_slider.png).

Needs /usr/bin/chromium (`apt-get install chromium`; .ci/run installs it). Never
`playwright install`: that downloads a browser build, which this network refuses.
"""
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SHOT = ROOT / "out" / "browser" / "02_budget_slider.png"
# As the machine's notes say: without the background-networking flags chromium keeps
# trying hosts this closed network refuses.
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage"]

if not os.path.exists(CHROMIUM):
    if os.environ.get("CI"):
        raise RuntimeError("CI needs Debian's chromium for the browser test; .ci/run installs it")
    pytest.skip("no chromium here (apt-get install chromium)", allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    """JupyterLab on 127.0.0.1 serving a copy of the notebook, in its own config dirs."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(ROOT / "notebooks" / "02_budget_slider.ipynb", work)
    port, token = _free_port(), "magis-test-token"
    labconfig = tmp_path / "cfg" / "labconfig"
    labconfig.mkdir(parents=True)
    # no "get notified about Jupyter news?" toast over the screenshot
    (labconfig / "page_config.json").write_text(
        '{"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": true}}')
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "cfg"),
               JUPYTER_DATA_DIR=str(tmp_path / "data"), JUPYTER_RUNTIME_DIR=str(tmp_path / "rt"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "ws"), MPLBACKEND="Agg")
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}", "--allow-root",
         "--LabApp.expose_app_in_browser=True", "--ServerApp.open_browser=False"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("JupyterLab did not start:\n"
                                       + (tmp_path / "lab.log").read_text()[-3000:])
                time.sleep(0.5)
        yield f"{base}/lab/tree/02_budget_slider.ipynb?reset&token={token}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.mark.slow
def test_slider_in_jupyterlab(lab):
    from playwright.sync_api import expect, sync_playwright
    SHOT.parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        try:
            page.goto(lab)
            page.wait_for_function("window.jupyterapp && window.jupyterapp.shell.currentWidget"
                                   " && window.jupyterapp.shell.currentWidget.sessionContext"
                                   " && window.jupyterapp.shell.currentWidget.sessionContext"
                                   ".session && window.jupyterapp.shell.currentWidget"
                                   ".sessionContext.session.kernel", timeout=90_000)
            page.evaluate("""async () => {
                const app = window.jupyterapp;
                if (!app.shell.leftCollapsed) await app.commands.execute('application:toggle-left-area');
                return app.commands.execute('notebook:run-all-cells');
            }""")
            check = page.locator(".jp-OutputArea-output", has_text="budget now:")
            expect(check).to_be_visible(timeout=300_000)
            slider = page.locator(".widget-slider").first
            readout = slider.locator(".widget-readout")
            status = page.locator(".widget-html", has_text="bound to").first
            image = page.locator("img.widget-image").first
            expect(image).to_be_visible()
            # %magis_budget 0.55 ran after the slider was drawn: the knob followed it
            expect(readout).to_have_text("0.55")
            before_src = image.get_attribute("src")
            before_status = status.inner_text()
            # type a budget into the readout, as a person would (Enter commits it)
            readout.click()
            page.keyboard.press("Control+A")
            page.keyboard.type("0.3")
            page.keyboard.press("Enter")
            expect(status).not_to_have_text(before_status, timeout=60_000)
            new = float(readout.inner_text())
            assert new < 0.55
            expect(status).to_contain_text(f"budget x{new:.2f}")
            page.wait_for_function(
                "src => document.querySelector('img.widget-image').src !== src", arg=before_src,
                timeout=60_000)
            # the kernel saw it: re-run the last cell, which prints the result's budget
            page.evaluate("""() => {
                const nb = window.jupyterapp.shell.currentWidget.content;
                nb.activeCellIndex = nb.widgets.length - 1;
                return window.jupyterapp.commands.execute('notebook:run-cell');
            }""")
            expect(check).to_contain_text(f"budget now: x{new:.2f}", timeout=60_000)
            expect(check).to_contain_text("bound module is the plan's: True")
            page.locator(".widget-slider").first.scroll_into_view_if_needed()
            page.screenshot(path=str(SHOT), full_page=False)
            if os.environ.get("MAGIS_SCREENSHOT"):
                shutil.copy(SHOT, os.environ["MAGIS_SCREENSHOT"])
        except BaseException:
            page.screenshot(path=str(SHOT), full_page=False)
            print(f"browser test failed; screenshot: {SHOT}")
            raise
        finally:
            browser.close()

"""The web page of ``lantern serve`` in a real browser (Debian's chromium, headless, through
selenium): pick a label, generate side by side with AR, and the page shows the model's image with
its statistics. The screenshot goes to ``$LANTERN_TEST_ARTIFACTS`` (else pytest's tmp_path)."""

from __future__ import annotations

import base64
import io
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import served
from PIL import Image

import lantern
from lantern.serve.app import create_app
from lantern.serve.scheduler import Scheduler

PAGE_TIMEOUT = 60.0  # seconds for every wait on the page (the two images take about 3 s on 2 idle cores)
LABEL, SEED, METHOD = 7, 0, "sjd-coupled"


def _browser_paths() -> tuple[str, str]:
    """Debian's chromium and chromedriver; missing ones fail the test (this test is part of the suite)."""
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    driver = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    missing = [p for p in (chromium, driver) if not Path(p).is_file()]
    if missing:
        pytest.fail(f"{', '.join(missing)} not found: run scripts/setup.sh (it installs Debian's chromium and "
                    "chromium-driver)")
    return chromium, driver


@pytest.fixture(scope="module")
def pipe() -> lantern.Pipeline:
    return lantern.load("digits", deterministic=True)  # codes equal alone and in any batch, on any CPU


@pytest.fixture
def browser() -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver_path = _browser_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium  # never a browser that selenium would download
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,640"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_page_load_timeout(PAGE_TIMEOUT)
    driver.set_script_timeout(PAGE_TIMEOUT)
    try:
        yield driver
    finally:
        driver.quit()


def _data_url_png(src: str) -> Image.Image:
    prefix = "data:image/png;base64,"
    assert src.startswith(prefix), src[:40]
    return Image.open(io.BytesIO(base64.b64decode(src[len(prefix):])))


def test_the_page_generates_side_by_side_with_ar(pipe: lantern.Pipeline, browser: object,
                                                 tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    driver = browser  # a selenium WebDriver
    scheduler = Scheduler(pipe, max_batch=2, max_queue=8)
    scheduler.start()
    app = create_app(scheduler, pipeline=pipe, default_method="lantern++")
    with served(app) as url:
        driver.get(url)  # type: ignore[attr-defined]
        wait = WebDriverWait(driver, PAGE_TIMEOUT)
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#method option")) > 1)
        assert driver.find_element(By.ID, "label").get_attribute("max") == "9"  # type: ignore[attr-defined]
        assert not driver.find_element(By.ID, "negative_prompt").is_displayed()  # type: ignore[attr-defined]
        Select(driver.find_element(By.ID, "method")).select_by_value(METHOD)  # type: ignore[attr-defined]
        label = driver.find_element(By.ID, "label")  # type: ignore[attr-defined]
        label.clear()
        label.send_keys(str(LABEL))
        driver.find_element(By.ID, "compare").click()  # type: ignore[attr-defined]
        driver.find_element(By.ID, "generate").click()  # type: ignore[attr-defined]
        wait.until(lambda d: d.find_element(By.ID, "image-main").get_attribute("data-final") == "true"
                   and not d.find_element(By.ID, "speedup").get_attribute("hidden"))
        status = driver.find_element(By.ID, "status").text  # type: ignore[attr-defined]
        image = _data_url_png(driver.find_element(By.ID, "image-main").get_attribute("src"))  # type: ignore[attr-defined]
        ar_image = _data_url_png(driver.find_element(By.ID, "image-ar").get_attribute("src"))  # type: ignore[attr-defined]
        tau = float(driver.find_element(By.ID, "tau-main").text)  # type: ignore[attr-defined]
        tau_ar = float(driver.find_element(By.ID, "tau-ar").text)  # type: ignore[attr-defined]
        latency = driver.find_element(By.ID, "latency-main").text  # type: ignore[attr-defined]
        speedup = driver.find_element(By.ID, "speedup").text  # type: ignore[attr-defined]
        driver.execute_script("window.scrollTo(0, 0)")  # type: ignore[attr-defined]
        shot = Path(os.environ.get("LANTERN_TEST_ARTIFACTS") or tmp_path) / "serve.png"
        shot.parent.mkdir(parents=True, exist_ok=True)
        assert driver.save_screenshot(str(shot))  # type: ignore[attr-defined]
        print(f"screenshot: {shot}")
    assert status == "done"
    expected = pipe(labels=[LABEL], seed=SEED, method=METHOD).images[0]
    assert image.size == expected.size == (32, 32)  # the model's image size
    assert image.convert("RGB").tobytes() == expected.convert("RGB").tobytes()  # the API's very image
    assert ar_image.size == expected.size
    assert tau >= 1 and tau_ar == 1.0  # AR: one token per forward
    assert re.fullmatch(r"\d+\.\d\d s", latency), latency
    assert re.fullmatch(rf"{METHOD}: \d+\.\d\dx the speed of ar \(same seed\)", speedup), speedup


def test_the_page_refuses_an_infinite_setting_and_shows_a_plain_text_error(pipe: lantern.Pipeline, browser: object,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 38: a temperature of 1e999 was sent as null (JSON.stringify(Infinity)), so the model's
    default ran instead; a plain-text 500 (here: a bug outside the API's error handling) showed
    "JSON.parse: unexpected character" instead of the status and its text. (Chromium's number input
    itself refuses a typed 1e999; the page's own check is for what gets past it, here a text input.)"""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from lantern.serve import app as app_module

    driver = browser  # a selenium WebDriver
    scheduler = Scheduler(pipe, max_batch=2, max_queue=8)
    scheduler.start()
    app = create_app(scheduler, pipeline=pipe, default_method="ar")
    planned: list[object] = []
    real_plan = app_module.plan_request

    def plan(*args: object) -> object:
        planned.append(args)
        return real_plan(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(app_module, "plan_request", plan)
    with served(app) as url:
        driver.get(url)  # type: ignore[attr-defined]
        wait = WebDriverWait(driver, PAGE_TIMEOUT)
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#method option")) > 1)
        planned.clear()  # the server plans one request of its own at start-up (warming its worker)
        status = driver.find_element(By.ID, "status")  # type: ignore[attr-defined]
        temperature = driver.find_element(By.ID, "temperature")  # type: ignore[attr-defined]
        driver.execute_script("arguments[0].type = 'text'", temperature)  # type: ignore[attr-defined]
        temperature.send_keys("1e999")
        driver.find_element(By.ID, "generate").click()  # type: ignore[attr-defined]
        wait.until(lambda d: status.get_attribute("class") == "error")
        assert status.text == "temperature: not a finite number: 1e999" and planned == [], status.text

        def broken(*args: object) -> object:
            raise RuntimeError("a bug: Starlette answers a plain-text 500")

        monkeypatch.setattr(app_module, "plan_request", broken)
        temperature.clear()
        status_before = status.text
        driver.find_element(By.ID, "generate").click()  # type: ignore[attr-defined]
        wait.until(lambda d: status.text not in (status_before, "generating…"))
        assert status.text == "HTTP 500: Internal Server Error" and status.get_attribute("class") == "error"


def test_an_emu3_page_sends_its_negative_prompt(browser: object, tmp_path: Path) -> None:
    """On an Emu3 model the page shows a negative prompt field, the model's own as its placeholder;
    the typed one goes with the request (and with the side-by-side AR run): the page's images are
    the API's with that negative prompt, not with the model's."""
    pytest.importorskip("transformers")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    from lantern.targets.emu3 import NEGATIVE_PROMPT
    from lantern.testing import make_tiny_emu3_folder

    # 6 x 6 codes: longer than sjd-coupled's default window of 16
    emu3 = lantern.load(make_tiny_emu3_folder(tmp_path / "emu3"), image_size=48, deterministic=True)
    driver = browser  # a selenium WebDriver
    scheduler = Scheduler(emu3, max_batch=2, max_queue=8)
    scheduler.start()
    app = create_app(scheduler, pipeline=emu3, default_method="ar")
    prompt, negative = "a red car", "blurry, dark"
    with served(app) as url:
        driver.get(url)  # type: ignore[attr-defined]
        wait = WebDriverWait(driver, PAGE_TIMEOUT)
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#method option")) > 1)
        field = driver.find_element(By.ID, "negative_prompt")  # type: ignore[attr-defined]
        assert field.is_displayed() and field.get_attribute("placeholder") == NEGATIVE_PROMPT
        Select(driver.find_element(By.ID, "method")).select_by_value(METHOD)  # type: ignore[attr-defined]
        driver.find_element(By.ID, "prompt").send_keys(prompt)  # type: ignore[attr-defined]
        field.send_keys(negative)
        driver.find_element(By.ID, "compare").click()  # type: ignore[attr-defined]
        driver.find_element(By.ID, "generate").click()  # type: ignore[attr-defined]
        wait.until(lambda d: d.find_element(By.ID, "image-main").get_attribute("data-final") == "true"
                   and not d.find_element(By.ID, "speedup").get_attribute("hidden"))
        image = _data_url_png(driver.find_element(By.ID, "image-main").get_attribute("src"))  # type: ignore[attr-defined]
        ar_image = _data_url_png(driver.find_element(By.ID, "image-ar").get_attribute("src"))  # type: ignore[attr-defined]
    def rgb(method: str, n: str | None) -> bytes:
        return emu3(prompts=[prompt], seed=SEED, method=method, negative_prompt=n).images[0].convert("RGB").tobytes()

    pixels = {name: [rgb(name, n) for n in (negative, None)] for name in (METHOD, "ar")}
    assert image.convert("RGB").tobytes() == pixels[METHOD][0] != pixels[METHOD][1]
    assert ar_image.convert("RGB").tobytes() == pixels["ar"][0] != pixels["ar"][1]

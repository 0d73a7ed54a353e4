"""The Lab the browser tests start: nothing of JupyterLab's own covers the widgets in screenshots."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

NEWS_PLUGIN = "@jupyterlab/apputils-extension:announcements"  # the plugin that asks (conftest disables it)

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def test_lab_never_asks_about_jupyter_news(lab, lab_notebook):
    with urllib.request.urlopen(lab.url("lab"), timeout=30) as r:
        page_html = r.read().decode()
    config = json.loads(re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>',
                                  page_html, re.DOTALL).group(1))
    assert NEWS_PLUGIN in config["disabledExtensions"]
    nb = lab_notebook(cells=["1 + 1"])
    page = nb.page
    assert page.evaluate("(id) => window.jupyterapp.hasPlugin(id)", NEWS_PLUGIN) is False
    assert page.evaluate("() => window.jupyterapp.hasPlugin('@jupyterlab/apputils-extension:notification')")
    page.wait_for_timeout(3000)  # the news question used to pop up a moment after the Lab loaded
    assert page.get_by_text("official Jupyter news").count() == 0
    nb.screenshot("lab_without_news_toast")

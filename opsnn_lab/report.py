"""``python -m opsnn_lab.report``: execute every notebook and render one static HTML site.

``make demo`` runs this. Each notebook in ``notebooks/`` is executed by papermill with
its own defaults into ``build/notebooks/``; each executed notebook becomes a page of
``build/report/`` with its plotly figures interactive (plotly.js ships once, as
``plotly.min.js`` beside the pages) and a front page ``index.html`` summarising the
figures every notebook recorded (``opsnn_lab.record``) and the benchmark JSON found in
``build/bench/``. The site opens from the file system: no server, no kernel.

A notebook that fails still gets its page (with the error shown) and the command exits
non-zero after rendering everything, so one failure never loses the rest of the report.
"""

from __future__ import annotations

import argparse
import html
import json
import re
import shutil
import sys
from pathlib import Path

from opsnn_lab.recording import RECORD_MIME

PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"

__all__ = ["build_report", "recorded_figures", "main"]


def recorded_figures(nb) -> dict:
    """``{name: value}`` of every ``opsnn_lab.record`` output in an executed notebook (last wins)."""
    out = {}
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            payload = o.get("data", {}).get(RECORD_MIME)
            if payload:
                out[payload["name"]] = payload["value"]
    return out


def _plotly_html(fig_json: dict, div_id: str) -> str:
    data = json.dumps(fig_json.get("data", []))
    layout = json.dumps(fig_json.get("layout", {}))
    return (f'<div id="{div_id}" class="plotly-graph-div opsnn-figure" style="min-height:360px"></div>'
            f'<script>Plotly.newPlot("{div_id}", {data}, {layout}, {{"responsive": true}});</script>')


def _staticize(nb, stem: str) -> int:
    """Turn plotly outputs into HTML that uses the page's one plotly.js; drop live-widget views."""
    n = 0
    # Saved widget state (megabytes of widget JS) needs a live widget manager from a CDN: drop it.
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            data = o.get("data")
            if not data:
                continue
            if PLOTLY_MIME in data:
                data["text/html"] = _plotly_html(data[PLOTLY_MIME], f"{stem}-fig{n}")
                n += 1
                for k in (PLOTLY_MIME, WIDGET_MIME, "image/png", "text/plain"):
                    data.pop(k, None)
            elif WIDGET_MIME in data:
                data.pop(WIDGET_MIME)  # no widget state in a static page; text/plain remains
            if RECORD_MIME in data:
                value = json.dumps(data.pop(RECORD_MIME)["value"])
                text = data.get("text/plain", "")
                data["text/html"] = f'<code class="opsnn-record">{html.escape(text if text else value)}</code>'
    return n


def _execute(src: Path, dst: Path, parameters: dict) -> str | None:
    import papermill as pm

    from opsnn_lab.validate.execute import kernel_manager_class

    try:
        pm.execute_notebook(str(src), str(dst), parameters=parameters, kernel_name="python3",
                            progress_bar=False, cwd=str(src.parent), kernel_manager_class=kernel_manager_class())
    except Exception as exc:  # papermill writes the partial notebook before raising
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def _render_page(nb_path: Path, out_dir: Path, error: str | None) -> tuple[int, dict]:
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(nb_path, as_version=4)
    figures = recorded_figures(nb)
    n_figs = _staticize(nb, nb_path.stem)
    exporter = HTMLExporter(template_name="lab")
    body, _ = exporter.from_notebook_node(nb)
    banner = (f'<div style="background:#fde8e8;border:1px solid #e02424;padding:12px;margin:12px">'
              f"<b>This notebook failed:</b> {html.escape(error)}</div>") if error else ""
    head = '<script src="plotly.min.js"></script>'
    nav = '<div style="padding:8px 16px;font-family:sans-serif"><a href="index.html">&larr; opsnn_lab report</a></div>'
    # The template links require.js and MathJax from a CDN; the site must work offline, and an AMD
    # loader on the page would also stop plotly.js from defining window.Plotly.
    body = re.sub(r'<script[^>]+src="https://[^"]*(require|mathjax)[^"]*"[^>]*>\s*</script>', "", body,
                  flags=re.IGNORECASE)
    body = body.replace("<head>", f"<head>\n{head}", 1)
    idx = body.find(">", body.find("<body")) + 1
    body = body[:idx] + nav + banner + body[idx:]
    (out_dir / f"{nb_path.stem}.html").write_text(body, encoding="utf-8")
    return n_figs, figures


def _bench_rows(bench_dir: Path) -> list[tuple[str, str]]:
    rows = []
    for path in sorted(bench_dir.glob("*.json")):
        try:
            payload = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        headline = payload.get("headline") or {}
        for key, value in headline.items():
            rows.append((f"{path.stem}: {key}", json.dumps(value)))
        if not headline:
            rows.append((path.stem, f'<a href="../bench/{path.name}">{path.name}</a>'))
    return rows


_NO_BENCH = "<p>No benchmark results in build/bench/ yet: run <code>make bench</code>.</p>"


def _fmt(value) -> str:
    """Figures as a person reads them: 4 significant digits, lists and dicts likewise."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value[:8]) + (", ..." if len(value) > 8 else "") + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in list(value.items())[:8]) + "}"
    return json.dumps(value)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _counts(page: dict) -> str:
    """What a page holds, as the front page shows it: recorded figures (its table rows) and plots."""
    return f"{_count(len(page['figures']), 'figure')}, {_count(page['n_figs'], 'plot')}"


def _index(pages: list[dict], bench: list[tuple[str, str]]) -> str:
    items = []
    for p in pages:
        status = "failed" if p["error"] else "ok"
        figs = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(_fmt(v))[:120]}</td></tr>"
                       for k, v in p["figures"].items())
        items.append(f'<section><h2><a href="{p["stem"]}.html">{html.escape(p["stem"])}</a> '
                     f'<small class="{status}">{status}, {_counts(p)}</small></h2>'
                     f'<table>{figs}</table></section>')
    bench_html = "".join(f"<tr><td>{html.escape(k)}</td><td>{v}</td></tr>" for k, v in bench)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>opsnn_lab report</title>
<style>body{{font-family:system-ui,sans-serif;max-width:960px;margin:2em auto;color:#222}}
table{{border-collapse:collapse;margin:.5em 0 1.5em}}td{{border-bottom:1px solid #ddd;padding:3px 12px}}
small.ok{{color:#057a55}}small.failed{{color:#e02424}}h2 a{{text-decoration:none}}</style></head><body>
<h1>opsnn_lab report</h1>
<p>Every notebook executed with its defaults; pages open without a server. Figures below are the values each
notebook recorded with <code>opsnn_lab.record</code>.</p>
{''.join(items)}
<h2>Benchmarks</h2>{'<table>' + bench_html + '</table>' if bench else _NO_BENCH}
</body></html>"""


def build_report(notebooks: list[Path], build: Path = Path("build"), execute: bool = True,
                 parameters: dict | None = None) -> tuple[Path, list[dict]]:
    import plotly
    from tqdm.auto import tqdm

    executed, site = build / "notebooks", build / "report"
    executed.mkdir(parents=True, exist_ok=True)
    site.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(plotly.__file__).parent / "package_data" / "plotly.min.js", site / "plotly.min.js")
    pages = []
    for src in tqdm(notebooks, desc="notebooks", unit="nb"):
        dst = executed / src.name
        error = _execute(src, dst, parameters or {}) if execute else None
        if not dst.exists():
            shutil.copy(src, dst)
        n_figs, figures = _render_page(dst, site, error)
        pages.append({"stem": src.stem, "error": error, "n_figs": n_figs, "figures": figures})
    (site / "index.html").write_text(_index(pages, _bench_rows(build / "bench")), encoding="utf-8")
    return site / "index.html", pages


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opsnn_lab.report", description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", type=Path, help="notebooks (default: notebooks/*.ipynb)")
    ap.add_argument("--build", type=Path, default=Path("build"), help="output root (default: build)")
    ap.add_argument("--no-execute", action="store_true", help="render build/notebooks as they are")
    args = ap.parse_args(argv)
    nbs = args.notebooks or sorted(Path("notebooks").glob("*.ipynb"))
    missing = [str(p) for p in nbs if not p.exists()]
    if missing:
        ap.error(f"notebook not found: {', '.join(missing)}")
    if not nbs:
        ap.error("no notebooks found (looked in notebooks/*.ipynb)")
    index, pages = build_report(nbs, args.build, execute=not args.no_execute)
    for p in pages:
        print(f"{'FAILED' if p['error'] else 'ok':6} {p['stem']}: {_counts(p)}"
              + (f"  ({p['error']})" if p["error"] else ""))
    print(f"report: {index.resolve()}")
    return 1 if any(p["error"] for p in pages) else 0


if __name__ == "__main__":
    sys.exit(main())

"""The conformance report as one self-contained HTML page (``dstest --html PATH``, ``--dstest-html=PATH``).

Built from the same :class:`dstest.report.Result` list as the table, the JSON and the JUnit XML: nothing
is classified again here. Per target, a matrix of contract x spec x world size whose cells are coloured
pass / FAIL / DEV / skip; under it every failure and deviation with its evidence (the one-line detail and
each failing rank's traceback) and the ``dstest`` command that reruns it. Filters (target, contract,
outcome, text) show and count only the runs that match.

The page needs nothing but itself: CSS and script inline, no request leaves it, and its Content Security
Policy allows only the page's own style and script (by hash), so text from a run (an exception message
holding ``</script>``) is escaped text and could not run even if it were not.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import html
import os
import re
import shlex
from collections.abc import Sequence

from dstest.report import DEVIATION, SYMBOL, Result, contract_key, counts

__all__ = ["check_output_path", "render", "reproduce", "write_html"]

#: The outcomes in the order the page shows them, with their CSS class.
_OUTCOMES = {"pass": "pass", "fail": "fail", DEVIATION: "dev", "skip": "skip"}
#: Characters pytest's ``-k`` takes in a name (so a parameter id can join the expression as it is).
_K_NAME = re.compile(r"[\w.+:/-]+")
_NO_CONTRACT = "-"

_STYLE = """
:root { --pass: #1a7f37; --fail: #cf222e; --dev: #9a6700; --skip: #6e7781; font-family: system-ui, sans-serif; }
body { margin: 1rem 1.5rem; color: #1f2328; }
h1 { font-size: 1.4rem; margin: 0 0 .3rem; }
h2 { font-size: 1.15rem; margin: 1.4rem 0 .4rem; }
h3 { font-size: 1rem; margin: 1rem 0 .3rem; }
.meta { color: #59636e; margin: .2rem 0; }
code, pre { font-family: ui-monospace, monospace; font-size: .85rem; }
#counts { display: flex; gap: 1rem; align-items: baseline; margin: .6rem 0; flex-wrap: wrap; }
#counts .count { font-weight: 600; }
#filters { display: flex; gap: .8rem; align-items: center; flex-wrap: wrap; padding: .5rem 0;
  border-top: 1px solid #d1d9e0; border-bottom: 1px solid #d1d9e0; position: sticky; top: 0; background: #fff; }
#filters input[type=search] { width: 18rem; }
table.matrix { border-collapse: collapse; font-size: .85rem; }
table.matrix th, table.matrix td { border: 1px solid #d1d9e0; padding: .15rem .4rem; text-align: left; }
table.matrix thead th { background: #f6f8fa; position: sticky; top: 2.6rem; }
td.spec { font-family: ui-monospace, monospace; }
.case { display: inline-block; padding: 0 .3rem; border-radius: 3px; color: #fff; white-space: nowrap; }
.case a { color: inherit; }
.case small { opacity: .85; }
.case.pass, .count.pass { background: var(--pass); }
.case.fail, .count.fail { background: var(--fail); }
.case.dev, .count.dev { background: var(--dev); }
.case.skip, .count.skip { background: var(--skip); }
.count { color: #fff; padding: .05rem .5rem; border-radius: 3px; }
.case.off { visibility: hidden; }
.finding { border-left: 4px solid var(--fail); padding: .2rem .8rem; margin: .6rem 0; background: #f6f8fa; }
.finding.dev { border-left-color: var(--dev); }
.finding .head { font-weight: 600; }
.finding pre { white-space: pre-wrap; margin: .3rem 0; }
.finding pre.cmd { background: #fff; border: 1px solid #d1d9e0; padding: .3rem .5rem; }
"""

_SCRIPT = """
(function () {
  "use strict";
  var form = document.getElementById("filters");
  var cases = Array.prototype.slice.call(document.querySelectorAll(".case"));
  var rows = Array.prototype.slice.call(document.querySelectorAll("tr.row"));
  var sections = Array.prototype.slice.call(document.querySelectorAll("section.target"));
  var findings = Array.prototype.slice.call(document.querySelectorAll(".finding"));
  function state() {
    var outcomes = {};
    form.querySelectorAll("input[name=outcome]").forEach(function (box) { outcomes[box.value] = box.checked; });
    var field = function (name) { return form.elements.namedItem(name).value; };
    return { target: field("target"), contract: field("contract"), outcomes: outcomes,
             text: field("text").trim().toLowerCase() };
  }
  function keep(el, s) {
    var d = el.dataset;
    return (!s.target || d.target === s.target) && (!s.contract || d.contract === s.contract) &&
      s.outcomes[d.outcome] === true && (!s.text || d.text.indexOf(s.text) !== -1);
  }
  function apply() {
    var s = state(), shown = 0, count = {};
    form.querySelectorAll("input[name=outcome]").forEach(function (box) { count[box.value] = 0; });
    cases.forEach(function (c) {
      var on = keep(c, s);
      c.classList.toggle("off", !on);
      if (on) { count[c.dataset.outcome] += 1; shown += 1; }
    });
    rows.forEach(function (r) { r.hidden = r.querySelector(".case:not(.off)") === null; });
    findings.forEach(function (f) { f.hidden = !keep(f, s); });
    sections.forEach(function (sec) {
      sec.hidden = sec.querySelector("tr.row:not([hidden])") === null;
      var list = sec.querySelector(".findings");
      if (list) { list.hidden = list.querySelector(".finding:not([hidden])") === null; }
    });
    Object.keys(count).forEach(function (k) {
      document.querySelector('[data-count="' + k + '"]').textContent = String(count[k]);
    });
    document.getElementById("shown").textContent = shown + " of " + cases.length + " runs shown";
  }
  form.addEventListener("input", apply);
  form.addEventListener("change", apply);
  form.addEventListener("reset", function () { window.setTimeout(apply, 0); });
  form.addEventListener("submit", function (event) { event.preventDefault(); });
  apply();
})();
"""


def check_output_path(value: str, setting: str) -> str:
    """``value`` as a file to write: its directory must exist and it must not be a directory.

    Checked before a run starts, so a long run does not end in an error about where to put its report.
    """
    from dstest.errors import InvalidArgument

    if not value.strip():
        raise InvalidArgument(f"{setting}={value!r}: give the path of a file to write, e.g. report.html")
    path = os.path.abspath(value)
    if os.path.isdir(path):
        raise InvalidArgument(f"{setting}={value!r} is a directory; give the path of a file in it, e.g. report.html")
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise InvalidArgument(
            f"{setting}={value!r}: the directory {folder!r} does not exist; create it or give a path in an existing one"
        )
    return value


def reproduce(result: Result, plugins: Sequence[str] = ()) -> str:
    """The ``dstest`` command that reruns ``result``'s case: its target, world, world size and spec.

    The spec name and the parameter id are ``-k`` terms; a parameter id that ``-k`` cannot take as a name
    (quotes, spaces) is left out, and the command then reruns every parameter of that spec.
    """
    keyword = result.spec
    if result.params and _K_NAME.fullmatch(result.params):
        keyword += f" and {result.params}"
    words = ["dstest", "--target", result.target, "--world", result.world, "--world-sizes", str(result.world_size)]
    for plugin in plugins:
        words += ["-p", plugin]
    return shlex.join([*words, "-k", keyword])


def _label(r: Result) -> str:
    return r.spec + (f"[{r.params}]" if r.params else "")


def _attrs(**values: str) -> str:
    return "".join(f' {name.replace("_", "-")}="{html.escape(value, quote=True)}"' for name, value in values.items())


def _case_data(r: Result) -> dict[str, str]:
    """The attributes the filters read: target, contract, outcome and the text a search matches."""
    text = " ".join(
        [r.target, r.world, r.contract or "", _label(r), f"ws{r.world_size}", SYMBOL[r.status], r.detail]
    ).lower()
    return {
        "data_target": r.target,
        "data_contract": r.contract or _NO_CONTRACT,
        "data_outcome": r.status,
        "data_text": text,
    }


def _case(index: int, r: Result) -> str:
    cls = _OUTCOMES[r.status]
    title = f"{SYMBOL[r.status]} ws{r.world_size} {r.seconds * 1000:.0f} ms" + (f": {r.detail}" if r.detail else "")
    shown = f"{SYMBOL[r.status]} <small>{r.seconds * 1000:.0f}ms</small>"
    if r.status in ("fail", DEVIATION):
        shown = f'<a href="#f{index}">{shown}</a>'
    return f'<span class="case {cls}" id="c{index}"{_attrs(title=title, **_case_data(r))}>{shown}</span>'


def _finding(index: int, r: Result, plugins: Sequence[str]) -> str:
    cls = _OUTCOMES[r.status]
    head = f"{SYMBOL[r.status]} {r.contract or ''} {_label(r)} · {r.world} ws{r.world_size}"
    parts = [
        f'<article class="finding {cls}" id="f{index}"{_attrs(**_case_data(r))}>',
        f'<p class="head"><a href="#c{index}">{html.escape(head)}</a></p>',
        f'<pre class="detail">{html.escape(r.detail or "(no message)")}</pre>',
        f'<p>reproduce:</p><pre class="cmd">{html.escape(reproduce(r, plugins))}</pre>',
    ]
    for rank, text in r.ranks.items():
        parts.append(f"<details><summary>rank {html.escape(rank)}</summary><pre>{html.escape(text)}</pre></details>")
    parts.append("</article>")
    return "\n".join(parts)


def _target_section(target: str, results: Sequence[tuple[int, Result]], plugins: Sequence[str]) -> str:
    sizes = sorted({r.world_size for _, r in results})
    rows: dict[tuple[str, str, str], dict[int, list[tuple[int, Result]]]] = {}
    for i, r in results:
        rows.setdefault((r.contract or "", _label(r), r.world), {}).setdefault(r.world_size, []).append((i, r))
    order = sorted(rows, key=lambda key: (contract_key(key[0] or None), key[1], key[2]))
    head = "".join(f"<th>ws{s}</th>" for s in sizes)
    body = []
    for contract, label, world in order:
        cells = rows[(contract, label, world)]
        shown = "".join("<td>" + "".join(_case(i, r) for i, r in cells.get(s, [])) + "</td>" for s in sizes)
        body.append(
            f'<tr class="row"><td>{html.escape(world)}</td><td>{html.escape(contract)}</td>'
            f'<td class="spec">{html.escape(label)}</td>{shown}</tr>'
        )
    findings = [_finding(i, r, plugins) for i, r in results if r.status in ("fail", DEVIATION)]
    parts = [
        f'<section class="target"{_attrs(data_target=target)}>',
        f"<h2>target {html.escape(target)}</h2>",
        f'<table class="matrix"><thead><tr><th>world</th><th>contract</th><th>spec</th>{head}</tr></thead>',
        "<tbody>",
        *body,
        "</tbody></table>",
    ]
    if findings:
        parts += ['<div class="findings">', "<h3>failures and deviations</h3>", *findings, "</div>"]
    parts.append("</section>")
    return "\n".join(parts)


def _digest(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def _versions() -> str:
    from importlib import metadata

    shown = []
    for name in ("dstest", "torch", "deepspeed"):
        try:
            shown.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return ", ".join(shown)


def _filters(targets: Sequence[str], contracts: Sequence[str]) -> str:
    """The page's filter form: a target, a contract, the outcomes shown, a text to look for."""
    option = '<option value="{0}">{0}</option>'.format
    boxes = "".join(
        f'<label><input type="checkbox" name="outcome" value="{status}" checked> {SYMBOL[status]}</label>'
        for status in _OUTCOMES
    )
    lines = [
        '<form id="filters" autocomplete="off">',
        '<label>target <select name="target"><option value="">all</option>'
        + "".join(option(html.escape(t, quote=True)) for t in targets)
        + "</select></label>",
        '<label>contract <select name="contract"><option value="">all</option>'
        + "".join(option(html.escape(c, quote=True)) for c in contracts)
        + "</select></label>",
        f"<span>{boxes}</span>",
        '<label>text <input type="search" name="text" placeholder="spec, parameter, message"></label>',
        '<button type="reset">clear filters</button>',
        "</form>",
    ]
    return "\n".join(lines)


def render(
    results: Sequence[Result],
    *,
    seconds: float | None = None,
    command: str | None = None,
    plugins: Sequence[str] = (),
    generated: datetime.datetime | None = None,
) -> str:
    """The page for ``results`` (any number of targets). ``command`` is shown as the run's command line;
    ``plugins`` are the ``-p`` modules the run loaded, repeated in every reproduce command."""
    generated = generated or datetime.datetime.now(datetime.timezone.utc)
    total = counts(results)
    targets = list(dict.fromkeys(r.target for r in results))
    contracts = sorted(
        {r.contract or _NO_CONTRACT for r in results}, key=lambda c: contract_key(c if c != _NO_CONTRACT else None)
    )
    indexed = list(enumerate(results))
    sections = [_target_section(t, [(i, r) for i, r in indexed if r.target == t], plugins) for t in targets]
    took = f" in {seconds:.1f} s" if seconds is not None else ""
    csp = f"default-src 'none'; style-src {_digest(_STYLE)}; script-src {_digest(_SCRIPT)}; img-src data:"
    shown_counts = "".join(
        f'<span class="count {cls}"><span data-count="{status}">{total[status]}</span> {SYMBOL[status]}</span>'
        for status, cls in _OUTCOMES.items()
    )
    page = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        '<link rel="icon" href="data:,">',
        f"<title>dstest conformance: {html.escape(', '.join(targets) or 'no runs')}</title>",
        f"<style>{_STYLE}</style></head><body>",
        "<header><h1>dstest conformance report</h1>",
        f'<p class="meta">{len(results)} runs{took} · generated {generated:%Y-%m-%d %H:%M} UTC · '
        f"{html.escape(_versions())}</p>",
    ]
    if command:
        page.append(f'<p class="meta">command: <code>{html.escape(command)}</code></p>')
    page += [
        f'<div id="counts">{shown_counts}<span id="shown">{len(results)} of {len(results)} runs shown</span></div>',
        _filters(targets, contracts) + "</header>",
        "<main>",
        *sections,
        "</main>",
        f"<script>{_SCRIPT}</script>",
        "</body></html>",
    ]
    return "\n".join(page) + "\n"


def write_html(
    results: Sequence[Result],
    path: str,
    *,
    seconds: float | None = None,
    command: str | None = None,
    plugins: Sequence[str] = (),
) -> None:
    """Write :func:`render`'s page for ``results`` to ``path`` (UTF-8)."""
    page = render(results, seconds=seconds, command=command, plugins=plugins)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(page)

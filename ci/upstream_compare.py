"""The table of ci/deepspeed_upstream.sh and ci/torch_upstream.sh: per path, the verdicts and times of
the suite's own run (BASELINE: DeepSpeed's harness, "harness"; torch's test bases, "upstream") and of the
plugin's run ("plugin"), from the JUnit files and wall times in OUT_DIR; every item whose verdict differs.

    python ci/upstream_compare.py OUT_DIR [BASELINE]
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

RUNS = ["harness", "plugin"]


def verdicts(path: Path) -> dict[str, tuple[str, float, str]]:
    """nodeid-like key -> (verdict, seconds, first line of the message)."""
    found: dict[str, tuple[str, float, str]] = {}
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, FileNotFoundError):
        return found
    for case in root.iter("testcase"):
        key = f"{case.get('classname', '')}::{case.get('name', '')}"
        verdict, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                verdict = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or (child.text or "")).strip().splitlines()[0:1]
                message = message[0][:160] if message else ""
                break
        found[key] = (verdict, float(case.get("time", 0.0)), message)
    return found


def main(out: Path) -> int:
    walls: dict[tuple[str, str], float] = {}
    for line in (out / "walls.txt").read_text().splitlines():
        m = re.match(r"(\w+) (\S+) rc=\d+ wall=([\d.]+)s", line)
        if m:
            walls[m.group(1), m.group(2)] = float(m.group(3))  # the last run of a path counts
    paths = sorted({p for _, p in walls}, key=lambda p: [q for r, q in walls].index(p))
    base = RUNS[0]
    print(f"| path | items | {base}: pass/fail/skip | plugin: pass/fail/skip | differ | {base} s | plugin s | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    differing: list[str] = []
    total = {run: 0.0 for run in RUNS}
    for p in paths:
        name = p.replace("/", "_").replace(".", "_")
        sides = {run: verdicts(out / f"{run}-{name}.xml") for run in RUNS}
        keys = sorted(set(sides[RUNS[0]]) | set(sides["plugin"]))
        counts = {run: Counter(v[0] for v in sides[run].values()) for run in RUNS}
        diff = [k for k in keys if sides[RUNS[0]].get(k, ("absent",))[0] != sides["plugin"].get(k, ("absent",))[0]]
        for k in diff:
            h = sides[RUNS[0]].get(k, ("absent", 0.0, ""))
            q = sides["plugin"].get(k, ("absent", 0.0, ""))
            differing.append(f"| {k} | {h[0]} | {q[0]} | {h[2] or q[2]} |")
        hw, pw = walls.get((RUNS[0], p)), walls.get(("plugin", p))
        for run, w in ((RUNS[0], hw), ("plugin", pw)):
            total[run] += w or 0.0
        ratio = f"{hw / pw:.1f}x" if hw and pw else "-"

        def fmt(c: Counter[str]) -> str:
            return f"{c['passed']}/{c['failed'] + c['error']}/{c['skipped']}"

        print(
            f"| {p} | {len(keys)} | {fmt(counts[RUNS[0]])} | {fmt(counts['plugin'])} | {len(diff)} | "
            f"{hw if hw is not None else '-'} | {pw if pw is not None else '-'} | {ratio} |"
        )
    if total[RUNS[0]] and total["plugin"]:
        print(
            f"\nall paths: {base} {total[base]:.0f} s, plugin {total['plugin']:.0f} s, "
            f"ratio {total[base] / total['plugin']:.1f}x"
        )
    print(f"\n{len(differing)} items differ")
    if differing:
        print(f"\n| item | {base} | plugin | message |\n|---|---|---|---|")
        print("\n".join(differing))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2:
        RUNS[0] = sys.argv[2]
    sys.exit(main(Path(sys.argv[1])))

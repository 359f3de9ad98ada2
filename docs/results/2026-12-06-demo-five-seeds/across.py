"""`melt-eval claims`' table and JSON across runs, built from each run's saved claims.json.

`melt-eval claims DIR...` computes every verdict from the runs' results directories. Seeds 0-3 of this page ran
on 2026-11-29 and only their `claims.json` (written by the same code at the end of each demo) was kept. This
reads those files back into the same `Claim` objects and renders them with the same table and JSON functions.
For seed 4, whose results were still on disk, the JSON from this script and from `melt-eval claims` were
compared and found equal.

    python across.py markdown "seed 0=claims-seed0.json" ... "seed 4=claims-seed4.json"
    python across.py json     "seed 0=claims-seed0.json" ...
"""
import json
import sys
from pathlib import Path

from melt_eval.report.claims import Claim, RunClaims, across_json
from melt_eval.report.render import render_markdown
from melt_eval.report.tables import claims_across_table

runs = []
for arg in sys.argv[2:]:
    label, path = arg.split("=", 1)
    runs.append(RunClaims(label, Path(path), [Claim(**c) for c in json.loads(Path(path).read_text())]))
if sys.argv[1] == "json":
    print(json.dumps(across_json(runs), indent=2))
else:
    print(render_markdown(claims_across_table(runs)), end="")

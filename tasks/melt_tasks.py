"""melt-eval's tasks as a LightEval custom-tasks module.

    lighteval custom ... --custom-tasks tasks/melt_tasks.py

The definitions live in `melt_eval.evaluation.tasks` so that an installed melt-eval has them too;
this file only hands LightEval the table.
"""

from melt_eval.evaluation.tasks import TASKS_TABLE  # noqa: F401

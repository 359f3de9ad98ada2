"""melt-eval's tasks as a LightEval custom-tasks module, for LightEval's own command line:

    lighteval accelerate "model_name=..." "melt_aime24|0" --custom-tasks tasks/melt_tasks.py

Task names are melt-eval's with a `melt_` prefix (LightEval refuses custom tasks that share a
built-in task's name); `melt_mmlu_redux` runs all 57 subjects. The definitions live in
`melt_eval.evaluation.tasks` so that an installed melt-eval has them too; `melt-eval run` uses the
same prompt functions and metrics through LightEval's Pipeline.
"""

from melt_eval.evaluation.tasks import lighteval_cli_table

TASKS_TABLE = lighteval_cli_table()  # built when LightEval loads this file, not when melt-eval imports its tasks

"""The paper's protocol as data, at the bottom of the harness (docs/method.md#ablation-rows and
docs/method.md#evaluation-protocol).

    variants.py  every ablation variant: its training overrides, evaluation options, paper key and label
    tasks.py     the benchmarks (problems, samples, metrics, source), the task groups, `expand`
    labels.py    the labels the paper's tables print: benchmarks, and the paper's name of each main model

Everything here is plain data and stdlib: it imports nothing from the harness but `melt_eval.errors`, so
every layer (evaluation, training, experiments, the report, the command line) reads it and none restates it.
tests/test_imports.py holds it to that.
"""

"""`melt-eval ablate`: plans, --dry-run, shared runs, and the KV-sharing settings."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from melt_eval.experiments import ablations
from melt_eval.cli import app

runner = CliRunner()

EXPECTED = {
    "gates": ["elementwise", "scalar", "ema-0.2", "mean", "last"],
    "components": ["full", "no-align", "no-interp", "no-kd", "no-chunk"],
    "kv-sharing": ["ouro", "last-prefill", "last", "first-prefill", "first"],
}


@pytest.mark.parametrize("ablation", list(EXPECTED))
@pytest.mark.parametrize("preset", ["paper", "tiny"])
def test_dry_run_lists_every_variant_and_runs_nothing(tmp_path, ablation, preset, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["ablate", ablation, "--preset", preset, "--dry-run"], terminal_width=400)
    assert res.exit_code == 0, res.output
    steps = ablations.describe(ablations.plan(ablation, preset), tmp_path / "runs", tmp_path / "results",
                               "ablation", "native")
    assert list(dict.fromkeys(s["variant"] for s in steps)) == EXPECTED[ablation]
    for variant in EXPECTED[ablation]:
        assert variant in res.output
    assert list(tmp_path.iterdir()) == []  # no run, no results, no directories


def test_gate_and_ladder_runs_are_the_papers():
    gates = {v.name: v for v in ablations.plan("gates", "paper")}
    assert all(len(v.train) == 1 and v.train[0].recipe == "paper-phase1" for v in gates.values())  # phase 1 only
    from melt_eval.training.config import load_recipe

    assert gates["ema-0.2"].train[0].overrides == {"gate": "ema"}  # ema_decay 0.2 is the recipe's own value
    assert load_recipe("paper-phase1").ema_decay == 0.2
    comp = {v.name: v for v in ablations.plan("components", "paper")}
    assert [r.recipe for r in comp["full"].train] == ["paper-phase1", "paper-phase2"]
    assert comp["no-interp"].train[0].overrides == {"interpolation_steps": 0}
    assert comp["no-kd"].train[0].overrides == {"interpolation_steps": 0, "kd": False}
    assert comp["no-chunk"].train[0].overrides == {"interpolation_steps": 0, "kd": False, "chunk_size": 0}
    # one run serves three rows, as in the paper: gate elementwise = no-align = phase 1 of full
    ids = {gates["elementwise"].train[0].run_id, comp["no-align"].train[0].run_id, comp["full"].train[0].run_id}
    assert len(ids) == 1
    assert comp["full"].train[1].start is comp["full"].train[0]
    assert gates["elementwise"].gpu_hours.startswith("480") and comp["full"].gpu_hours.startswith("1,040")


def test_kv_sharing_variants_are_evaluation_only_with_the_spec_settings():
    kv = {v.name: v for v in ablations.plan("kv-sharing", "paper")}
    assert all(not v.train and v.base == "ouro-1.4b-thinking" for v in kv.values())
    assert kv["ouro"].eval_options == {"kv_sharing": None, "share_prompt": False}
    assert kv["last-prefill"].eval_options == {"kv_sharing": "last", "share_prompt": False}
    assert kv["first"].eval_options == {"kv_sharing": "first", "share_prompt": True}


def test_a_field_added_later_keeps_older_run_ids_at_its_old_value():
    """The demo teacher's id from before `prompt_as_one_chunk` existed: an older demo directory's teacher
    is reused, not retrained; the MELT runs, which now prefill the prompt whole, get new ids."""
    from melt_eval.experiments import demo

    # pretrain-tiny stops its teacher by held-out accuracy since issue 51: a new teacher, so a new id by design;
    # with that field at its old value (off), the ids of the teacher before it (c16210f4, a77fed27) are kept
    assert demo.teacher_run(demo.FULL).run_id == "pretrain-tiny-1fedd1ae"
    off = {"stop_at_heldout": None}
    assert ablations.TrainRun(0, "pretrain-tiny", off, "tiny-random-ouro").run_id.endswith("-c16210f4")
    assert ablations.TrainRun(0, "pretrain-tiny", {**off, "seed": 2}, "tiny-random-ouro").run_id.endswith("-a77fed27")
    run = ablations.plan("gates", "tiny")[0].train[0]
    assert run.run_id != ablations.TrainRun(run.phase, run.recipe, {**run.overrides, "prompt_as_one_chunk": False}, run.start).run_id


def test_train_overrides_change_the_run_id():
    a = ablations.plan("gates", "tiny")[0].train[0]
    b = ablations.plan("gates", "tiny", train_overrides={"max_steps": 3})[0].train[0]
    assert a.run_id != b.run_id and b.overrides["max_steps"] == 3


def test_unknown_ablation_is_a_one_line_error():
    res = runner.invoke(app, ["ablate", "nosuch", "--dry-run"])
    assert res.exit_code != 0
    assert "unknown ablation 'nosuch'" in str(res.exception)


@pytest.mark.parametrize("command", [["ablate", "gates", "--preset", "tiny", "--output"],
                                     ["ablate", "gates", "--preset", "tiny", "--runs"], ["demo", "--quick", "--output"]])
@pytest.mark.parametrize("where", ["a-file", "a-file/sub"])
def test_an_output_path_through_a_file_is_refused_before_anything_trains(tmp_path, monkeypatch, command, where):
    """ablate trained before its first evaluation found the file; the demo said so from inside its first stage,
    naming a runs directory the user never gave."""
    from melt_eval.experiments import demo

    def trains(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr(ablations, "run_variants", trains)
    monkeypatch.setattr(demo, "run_demo", trains)
    (tmp_path / "a-file").write_text("kept\n")
    res = runner.invoke(app, [*command, str(tmp_path / where)])
    assert res.exit_code != 0 and "is a file" in str(res.exception) and command[-1] in str(res.exception), res.exception
    assert (tmp_path / "a-file").read_text() == "kept\n"


@pytest.mark.timeout(60)
def test_a_fifo_or_a_list_where_a_record_goes_is_no_record_not_a_hang(tmp_path):
    """A FIFO named demo.json blocked `melt-eval demo` before anything ran, forever; a results.json holding a
    list was a traceback. Each is read as no record (the run then replaces it, or says what is wrong)."""
    import os

    from melt_eval.experiments import demo

    os.mkfifo(tmp_path / "demo.json")
    demo._check_same_demo(tmp_path / "demo.json", seed=0, quick=True)
    assert demo._previous_runs(tmp_path / "demo.json") == []
    (tmp_path / "fifo" / "synthetic").mkdir(parents=True)
    os.mkfifo(tmp_path / "fifo" / "synthetic" / "results.json")
    (tmp_path / "list" / "synthetic").mkdir(parents=True)
    (tmp_path / "list" / "synthetic" / "results.json").write_text("[1]")
    (tmp_path / "done" / "synthetic").mkdir(parents=True)
    (tmp_path / "done" / "synthetic" / "results.json").write_text('{"finished": true}')
    assert [ablations._finished(tmp_path / d, "synthetic") for d in ("fifo", "list", "done")] == [False, False, True]


def test_a_checkpoint_evaluated_once_is_copied_not_rerun(tmp_path, monkeypatch):
    """The KV-sharing table's `ouro` row and the demo's teacher are one evaluation (defaults spelled out or not)."""
    import json

    import melt_eval.evaluation as evaluation

    generated = []

    def fake_run_tasks(tasks, model, options, paths, **kwargs):
        out = paths.results_dir / tasks / "results.json"
        if not out.exists():  # run_tasks skips a finished task
            generated.append(paths.name)
            out.parent.mkdir(parents=True)
            out.write_text(json.dumps({"model": paths.name, "finished": True}))
        return [json.loads(out.read_text())]

    monkeypatch.setattr(evaluation, "run_tasks", fake_run_tasks)
    E = ablations.Evaluation
    res = ablations.evaluate_all([E("teacher", tmp_path / "kv" / "ouro", "ouro", {"kv_sharing": None, "share_prompt": False}),
                                  E("teacher", tmp_path / "ouro-tiny", "ouro-tiny"),
                                  E("teacher", tmp_path / "kv" / "last", "last", {"kv_sharing": "last", "share_prompt": True})],
                                 "synthetic")
    assert [r["model"] for r in res] == ["ouro", "ouro-tiny", "last"]
    assert generated == ["ouro", "last"]  # other options: evaluated, not copied


def test_each_variant_is_defined_once_and_read_by_ablate_and_the_report():
    """variants.py is the one definition: ablate plans exactly its variants with its overrides and options,
    and the report labels them (and picks fallbacks) from it."""
    from melt_eval.protocol import variants
    from melt_eval.report import paper

    for ablation, definition in variants.ABLATIONS.items():
        planned = {v.name: v for v in ablations.plan(ablation, "paper")}
        assert set(planned) == {v.name for v in definition.variants} == set(paper.ABLATIONS[ablation]["variants"])
        for v in definition.variants:
            assert paper.ABLATIONS[ablation]["variants"][v.name] == (v.paper_key, v.paper_label)
            assert paper.ABLATION_FALLBACKS.get((ablation, v.name)) == v.fallback
            if v.phase1 is None:  # evaluation only, with the variant's options
                assert not planned[v.name].train and planned[v.name].eval_options == v.eval_options
            else:  # the variant's phase-1 overrides (less those equal to the recipe's own), and phase 2 iff defined
                assert len(planned[v.name].train) == (2 if v.phase2 is not None else 1)
                assert planned[v.name].train[0].overrides.items() <= v.phase1.items()
    for (ablation, name), (where, other) in paper.ABLATION_FALLBACKS.items():  # a fallback names a real row
        assert where == "main" or other in {v.name for v in variants.ABLATIONS[where].variants}


def test_a_run_is_done_resumed_or_started_as_training_reports_it(tmp_path):
    """ablate's status comes from training (runs.run_state), not from reading the runner's files itself."""
    from melt_eval.training.runs import run_state

    run = ablations.plan("gates", "tiny")[0].train[0]
    out = tmp_path / run.run_id
    assert ablations.describe(ablations.plan("gates", "tiny")[:1], tmp_path, tmp_path, "synthetic", "native")[0]["status"] == "to do"
    out.mkdir()
    (out / "recipe.yaml").write_text("seed: 0\n")
    assert run_state(out) == "interrupted"
    assert ablations.describe(ablations.plan("gates", "tiny")[:1], tmp_path, tmp_path, "synthetic", "native")[0]["status"] == "resume"


def test_library_modules_import_no_typer():
    """Only command modules (*/cli.py, serve.py) import typer; the experiments and the report are libraries."""
    import subprocess
    import sys

    code = ("import sys; import melt_eval.experiments.ablations, melt_eval.experiments.demo, melt_eval.protocol.variants, "
            "melt_eval.report.tables, melt_eval.report.render, melt_eval.report.write, melt_eval.report.memory, "
            "melt_eval.training.runs; print(sorted(m for m in sys.modules if m.split('.')[0] in ('typer', 'vllm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_side_by_side_training_starts_phase_2_as_soon_as_its_phase_1_is_done():
    """With a free core, the demo's phase 2 starts before the phase-1 runs still waiting (it ends the longest
    chain); the phase-1 runs keep their listed order."""
    teacher = ablations.TrainRun(0, "pretrain-tiny", {}, "tiny-random-ouro")
    variants = [v for a in ("gates", "components") for v in ablations.plan(a, "tiny", teacher)]
    runs = {run.run_id: run for v in variants for run in v.train}
    full = next(v for v in variants if v.ablation == "components" and v.name == "full")
    phase1, phase2 = full.train
    pending = {k: r for k, r in runs.items() if k != phase1.run_id}  # the full phase 1 has finished
    order = [k for k, _ in ablations.start_order(pending, set(runs))]
    assert order[0] == phase2.run_id
    assert order[1:] == [k for k in runs if k not in (phase1.run_id, phase2.run_id)]
    # a phase 1 whose start (the teacher) is not in the batch is not a continuation
    assert [k for k, _ in ablations.start_order({phase1.run_id: phase1}, set(runs))] == [phase1.run_id]


def test_an_evaluation_runs_beside_training_as_soon_as_its_model_exists(tmp_path):
    """The demo's one queue: a job starts once the jobs it needs have finished, and a free worker takes the
    first startable job even while a long run still trains (here the long run waits for it to start)."""
    import helpers

    log = str(tmp_path / "log")
    Job = ablations._Job
    queue = [Job("train long", (helpers.queued_job, log, "train long", "evaluate teacher"), set()),
             Job("train short", (helpers.queued_job, log, "train short"), set()),
             Job("evaluate long", (helpers.queued_job, log, "evaluate long"), {"train long"}),
             Job("evaluate teacher", (helpers.queued_job, log, "evaluate teacher"), set())]
    ablations._run_side_by_side(queue, workers=2)
    events = (tmp_path / "log").read_text().splitlines()
    assert events.index("start evaluate teacher") < events.index("end train long")
    assert events.index("end train long") < events.index("start evaluate long")
    assert len(events) == 8
    with pytest.raises(RuntimeError, match="not queued"):
        ablations._run_side_by_side([Job("evaluate", (helpers.queued_job, log, "evaluate"), {"train"})], workers=2)


def test_runs_trained_side_by_side_equal_runs_trained_one_after_another(tmp_path):
    """`--jobs 2`: two phase-1 runs in worker processes, then the phase 2 that continues one of them,
    give the same weights as the same plan trained in this process, one run at a time; and the same records:
    a job computes with one thread either way, whatever this process's count, so no logged figure depends on
    how many cores ran the queue."""
    import torch
    from safetensors.torch import load_file

    from melt_eval.training.run_files import read_meta

    fast = {"seq_len": 48, "micro_batch_size": 2, "batch_tokens": 96, "max_steps": 2, "warmup_steps": 1,
            "chunk_size": 8, "save_every": 2, "tensorboard": False,
            "data": [{"source": "synthetic", "n": 20, "num_steps": 1}]}
    gates = ablations.plan("gates", "tiny", train_overrides=fast)
    full = next(v for v in ablations.plan("components", "tiny", train_overrides=fast) if v.name == "full")
    runs = [gates[1].train[0], *full.train]  # scalar gate; elementwise phase 1 and the phase 2 after it
    assert isinstance(runs[2].start, ablations.TrainRun) and runs[2].start.run_id == runs[1].run_id
    threads = torch.get_num_threads()
    ablations.train_runs(runs, tmp_path / "seq", jobs=1, progress=False)
    assert torch.get_num_threads() == threads  # this process's own count is given back
    ablations.train_runs(runs, tmp_path / "par", jobs=2, progress=False)
    for run in runs:
        a, b = (load_file(tmp_path / d / run.run_id / "model.safetensors") for d in ("seq", "par"))
        assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a), run.run_id
        paths = [read_meta(tmp_path / d / run.run_id)["float_path"] for d in ("seq", "par")]
        assert paths[0] == paths[1] and paths[0]["threads"] == ablations.JOB_THREADS, run.run_id
    # finished runs are skipped: nothing trains the second time
    ablations.train_runs(runs, tmp_path / "par", jobs=2, progress=False)


def test_final_gate_means_reads_the_last_logged_gate(tmp_path):
    """A run's gate at the end of training: the last record that logged one, averaged over layers."""
    from melt_eval.training.runs import final_gate_means

    assert final_gate_means(tmp_path) is None  # no log
    (tmp_path / "logs").mkdir()
    records = [{"step": 1, "gate_mean": {"layer0": [None, 0.4, 0.5], "layer1": [None, 0.6, 0.7]}},
               {"step": 2, "gate_mean": {"layer0": [None, 0.2, 0.3], "layer1": [None, 0.4, 0.6]}},
               {"step": 3, "loss": 0.1}]  # a step that logged no gate
    (tmp_path / "logs" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert final_gate_means(tmp_path) == [0.3, 0.45]
    (tmp_path / "logs" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    assert final_gate_means(tmp_path) is None  # a LoopLM run


def test_the_demos_compile_leaves_the_runs_that_cannot_compile_eager_and_says_so():
    """Issue 69 item 3: `demo --compile` reaches the exit chain's runs (exit-aware training at chunk 1, a gate fit),
    which never compiled: they drop compile (not part of a run's id), as the recipe check would refuse it."""
    from melt_eval.protocol import variants as definitions

    chain = ablations.chained_runs(definitions.variant("exit", "exit-aware-full"), "tiny", "tiny-random-melt",
                                   {"max_steps": 3, "compile": True})
    assert [r.recipe for r in chain] == ["tiny-exit-aware", "tiny-exit-gate"]
    assert all("compile" not in r.overrides and r.overrides["max_steps"] == 3 for r in chain)
    eager = ablations.chained_runs(definitions.variant("exit", "exit-aware-full"), "tiny", "tiny-random-melt",
                                   {"max_steps": 3})
    assert [r.run_id for r in chain] == [r.run_id for r in eager]
    phase1 = ablations.plan("components", "tiny", "tiny-random-ouro", {"compile": True})[0].train[0]
    assert phase1.overrides["compile"] is True  # a run that compiles keeps it

"""Early exit of generated tokens (`--exit`, melt_eval/modeling/early_exit.py): today's tokens without it,
what an exited token leaves in the cache, and the work the engine skips for exited rows."""

from __future__ import annotations

import pytest
import torch

from melt_eval.errors import UserError
from melt_eval.generation.engine import generate
from melt_eval.generation.options import InferenceOptions
from melt_eval.modeling import early_exit
from melt_eval.modeling.kv_cache import StaticStore, policy_for
from melt_eval.modeling.melt import MeltForCausalLM

PROMPTS = [[1, 5, 7, 9, 11], [3, 4]]
SAMPLE = dict(n=2, temperature=1.0, top_p=0.9, max_new_tokens=8, seed=0)


@pytest.fixture(scope="module")
def models(random_looplm):
    ouro = random_looplm(0.3)
    return {"ouro": ouro, "melt": MeltForCausalLM.from_looplm(ouro).eval()}


def _constant_gate(model, logit: float) -> None:
    """lambda_t = sigmoid(logit) at every loop, whatever the state."""
    with torch.no_grad():
        model.model.early_exit_gate.weight.zero_()
        model.model.early_exit_gate.bias.fill_(logit)


@pytest.mark.parametrize("kind", ["ouro", "melt"])
def test_without_exit_the_tokens_are_todays(models, kind):
    model = models[kind]
    today = generate(model, PROMPTS, **SAMPLE)
    assert today.loop_counts is None
    assert generate(model, PROMPTS, InferenceOptions(exit="gate:1"), **SAMPLE).sequences == today.sequences
    # the early-exit decode step at full depth (no row can agree 4 more times in 4 loops) is today's step
    full = generate(model, PROMPTS, InferenceOptions(exit="agree:4"), **SAMPLE)
    assert full.sequences == today.sequences
    decode_steps = [[len(s) - 1 for s in per] for per in full.sequences]
    assert [[c[:3] for c in per] for per in full.loop_counts] == [[[0, 0, 0]] * 2] * 2
    assert [[c[3] for c in per] for per in full.loop_counts] == decode_steps


def _prefilled(model, ids):
    """A one-row cache (room for one more token) after the prompt `ids` at full depth, and its policy."""
    layout = model.cache_layout(share_prompt=False)
    keys, _ = layout.store_keys()
    store = StaticStore(keys, batch=1, kv_heads=layout.kv_heads, capacity=len(ids) + 1, head_dim=layout.head_dim,
                        dtype=torch.float32, device="cpu")
    policy = policy_for(layout, store)
    with torch.no_grad():
        model.model.run_chunk(torch.tensor([ids]), torch.arange(len(ids))[None], policy)
    return store, policy


# lambda = 1/2 at every loop: the cumulative exit probability is 1/2, 3/4, 7/8 after loops 1, 2, 3
@pytest.mark.parametrize("q,depth", [(0.5, 1), (0.7, 2), (0.8, 3), (0.9, 4)])
@pytest.mark.parametrize("kind", ["ouro", "melt"])
def test_an_exited_token_leaves_its_exit_loop_state(models, random_looplm, kind, q, depth):
    model = models[kind]
    saved = model.model.early_exit_gate.weight.clone(), model.model.early_exit_gate.bias.clone()
    _constant_gate(model, 0.0)
    T, N, ids, token = 4, model.config.num_hidden_layers, PROMPTS[0], 13
    try:
        store, policy = _prefilled(model, ids)
        logits, used = early_exit.decode_step(model, torch.tensor([[token]]), torch.tensor([[len(ids)]]), policy,
                                              ("gate", q))
        # the same token run through `depth` loops only, over the same prompt
        ref_store, ref_policy = _prefilled(model, ids)
        model.config.total_ut_steps = depth
        with torch.no_grad():
            x, _ = model.model.run_chunk(torch.tensor([[token]]), torch.tensor([[len(ids)]]), ref_policy)
            ref_logits = model.lm_head(x[:, -1]).float()
    finally:
        model.config.total_ut_steps = 4
        with torch.no_grad():
            model.model.early_exit_gate.weight.copy_(saved[0])
            model.model.early_exit_gate.bias.copy_(saved[1])
    assert used.tolist() == [depth]
    torch.testing.assert_close(logits, ref_logits)
    p = len(ids)
    for i in range(N):
        if kind == "melt":  # the shared entry holds the state at the exit loop
            for a, b in zip(store.buffers[i], ref_store.buffers[i]):
                torch.testing.assert_close(a[:, :, p], b[:, :, p])
            continue
        for t in range(T):  # Ouro: loops up to the exit are its own, deeper loops a copy of the exit loop's
            for a, b in zip(store.buffers[(i, t)], ref_store.buffers[(i, min(t, depth - 1))]):
                torch.testing.assert_close(a[:, :, p], b[:, :, p])
        assert store.length == p + 1


def _mlp_rows(model, run) -> int:
    """Token rows the layers' MLPs processed while `run()` ran (every (layer, loop) step runs one)."""
    seen = []
    hooks = [layer.mlp.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0] * args[0].shape[1]))
             for layer in model.model.layers]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return sum(seen)


@pytest.mark.parametrize("kind", ["ouro", "melt"])
def test_the_engine_skips_the_loops_of_exited_rows(models, kind):
    model = models[kind]
    T, N, rows = 4, model.config.num_hidden_layers, len(PROMPTS) * SAMPLE["n"]
    steps = SAMPLE["max_new_tokens"] - 1  # no EOS given: every row decodes max_new_tokens - 1 steps
    full = _mlp_rows(model, lambda: generate(model, PROMPTS, **SAMPLE))
    saved = model.model.early_exit_gate.bias.clone(), model.model.early_exit_gate.weight.clone()
    _constant_gate(model, 0.0)
    try:
        result = []
        exited = _mlp_rows(model, lambda: result.append(generate(model, PROMPTS, InferenceOptions(exit="gate:0.7"),
                                                                 **SAMPLE)))
    finally:
        with torch.no_grad():
            model.model.early_exit_gate.bias.copy_(saved[0])
            model.model.early_exit_gate.weight.copy_(saved[1])
    # every generated token stops after loop 2: loops 3 and 4 of every decode step are not run
    assert result[0].loop_counts == [[[0, steps, 0, 0]] * 2] * 2
    assert full - exited == steps * rows * N * (T - 2)


def test_mixed_exits_run_only_the_active_rows(models):
    """agree:1 stops rows at different loops; the rows run equal the loops the engine reports."""
    model = models["ouro"]
    N = model.config.num_hidden_layers
    base = _mlp_rows(model, lambda: generate(model, PROMPTS, **dict(SAMPLE, max_new_tokens=1)))  # the prefill
    result = []
    rows = _mlp_rows(model, lambda: result.append(generate(model, PROMPTS, InferenceOptions(exit="agree:1"), **SAMPLE)))
    counts = [c for per in result[0].loop_counts for c in per]
    loops_run = sum(depth * n for c in counts for depth, n in enumerate(c, start=1))
    assert len({tuple(c) for c in counts}) > 1 or any(c[-1] < sum(c) for c in counts)  # exits really differ
    assert rows - base == loops_run * N


@pytest.mark.parametrize("spelling", ["gate:0", "gate:1.5", "gate:x", "agree:0", "agree:2.5", "stop:3", "gate"])
def test_a_wrong_exit_is_one_line(spelling):
    with pytest.raises(UserError, match=r"^--exit must be gate:Q .* got") as err:
        InferenceOptions(exit=spelling)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("compressed", [{"kv_cache_dtype": "int8"}, {"cross_loop_kv": True}])
def test_exit_with_a_compressed_cache_is_refused_in_one_line(compressed):
    # the early-exit step writes the full-precision stores' tensors; a quantized store would be bypassed
    with pytest.raises(UserError, match="--exit runs with the model's own cache") as err:
        InferenceOptions(exit="gate:0.5", **compressed)
    assert "\n" not in str(err.value)
    InferenceOptions(exit="gate:1", **compressed)  # gate:1 is all loops: nothing to refuse


def test_gate_one_is_the_default():
    assert InferenceOptions(exit="gate:1") == InferenceOptions()
    assert InferenceOptions(exit="gate:0.50").exit == "gate:0.5"
    assert InferenceOptions(exit="agree:2").exit_rule == ("agree", 2)


def test_a_run_records_the_loops_per_token(tmp_path):
    """`melt-eval run --exit`: results.json and details.jsonl say how many loops the generated tokens ran."""
    import json

    from helpers import main_exit_code

    args = ["run", "synthetic", "--model", "tiny-random-ouro", "--output", tmp_path, "--max-problems", "2",
            "--samples", "2", "--max-new-tokens", "6", "--no-progress", "--exit", "agree:1"]
    assert main_exit_code(args) == 0
    task_dir = tmp_path / "tiny-random-ouro" / "synthetic"
    result = json.loads((task_dir / "results.json").read_text())
    assert result["settings"]["exit"] == "agree:1"
    summary = result["loops_per_token"]
    histogram = summary["histogram"]
    assert set(histogram) == {"1", "2", "3", "4"} and histogram["1"] == 0  # agreeing needs two loops
    tokens = sum(histogram.values())
    assert 0 < tokens <= result["generated_tokens"]
    assert summary["mean"] == pytest.approx(sum(int(d) * n for d, n in histogram.items()) / tokens)
    details = [json.loads(x) for x in (task_dir / "details.jsonl").read_text().splitlines()]
    per_problem = [d["loops_per_token"]["histogram"] for d in details]
    assert {d: sum(h[d] for h in per_problem) for d in histogram} == histogram


@pytest.mark.parametrize("args,message", [
    (["--exit", "gate:2"], "--exit must be gate:Q"),
    (["--exit", "agree:1", "--backend", "endpoint", "--base-url", "http://127.0.0.1:9"], "native engine only"),
    (["--exit", "agree:1", "--backend", "vllm"], "--backend vllm runs every loop"),
])
def test_the_cli_refuses_exit_in_one_line(tmp_path, capsys, args, message):
    from helpers import main_exit_code, one_line_error

    code = main_exit_code(["run", "synthetic", "--model", "tiny-random-ouro", "--output", tmp_path / "out", *args])
    one_line_error(capsys, code, message)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["ouro", "melt"])
def test_rows_that_stop_at_different_loops_each_keep_their_own_state(models, monkeypatch, kind):
    """Two rows of one step: row 0 stops after loop 2, row 1 runs all 4 (the decider forced, so the gathered
    path is what is checked): each row's logits and cache entries are those of its own depth."""
    model = models[kind]
    T, N, ids, tokens = 4, model.config.num_hidden_layers, PROMPTS[0], [13, 21]

    def stops(self, model, h):  # row 0 of the batch (the first active row) stops after loop 2, once
        stop = torch.zeros(h.shape[0], dtype=torch.bool)
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 2:
            stop[0] = True
        return stop, None

    monkeypatch.setattr(early_exit._Decider, "stops", stops)
    store, policy = _prefilled(model, ids)
    two = {key: torch.cat([kv, kv], dim=1) for key, kv in store.buffers.items()}  # [2, B, KVH, S, hd]: rows on dim 1
    store.buffers = two
    logits, used = early_exit.decode_step(model, torch.tensor([[t] for t in tokens]),
                                          torch.tensor([[len(ids)]] * 2), policy, ("gate", 0.5))
    assert used.tolist() == [2, 4]
    p = len(ids)
    for row, depth in ((0, 2), (1, 4)):
        ref_store, ref_policy = _prefilled(model, ids)
        model.config.total_ut_steps = depth
        try:
            with torch.no_grad():
                x, _ = model.model.run_chunk(torch.tensor([[tokens[row]]]), torch.tensor([[p]]), ref_policy)
        finally:
            model.config.total_ut_steps = T
        # a batch of two against a batch of one: float sums in another order (random weights of std 0.3)
        close = dict(atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(logits[row : row + 1], model.lm_head(x[:, -1]).float(), **close)
        for i in range(N):
            # MELT: the shared entry; Ouro: loops up to the exit its own, deeper ones the exit loop's copy
            pairs = [(i, i)] if kind == "melt" else [((i, t), (i, min(t, depth - 1))) for t in range(T)]
            for ours, theirs in pairs:
                for a, b in zip(store.buffers[ours], ref_store.buffers[theirs]):
                    torch.testing.assert_close(a[row, :, p], b[0, :, p], **close)


def test_ablate_exit_plans_a_grid_on_ouro_and_melt(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from melt_eval.cli import app
    from melt_eval.experiments import ablations
    from melt_eval.protocol import variants

    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["ablate", "exit", "--preset", "tiny", "--dry-run"], terminal_width=400)
    assert res.exit_code == 0, res.output
    plan = ablations.plan("exit", "tiny")
    # the exit-aware rows continue a MELT with a recorded teacher: none of the registry models (tests/test_exit_aware.py)
    rules = [v.eval_options["exit"] for v in variants.EXIT.variants if not v.name.startswith(variants.EXIT_AWARE)]
    assert [(p.ablation, p.eval_options["exit"]) for p in plan] == [
        (f"exit/{m}", r) for m in ("tiny-random-ouro", "tiny-random-melt") for r in rules]
    # every row but the fitted-gate ones (tests/test_exit_gate.py) evaluates the model as is
    as_is = [p for p in plan if not p.name.startswith(variants.FITTED_GATE)]
    assert all(not p.train for p in as_is) and rules[0] is None and "gate:0.9" in rules and "agree:2" in rules
    steps = ablations.describe(as_is, tmp_path / "runs", tmp_path / "results", "synthetic", "native")
    assert sum(s["command"].endswith("--exit gate:0.9") for s in steps) == 2
    assert list(tmp_path.iterdir()) == []  # nothing run
    assert "exit" not in variants.ABLATIONS  # not one of the paper's tables, not in the demo's plan
    assert [p.base or p.train[0].start for p in ablations.plan("exit", "paper", "some/ckpt")] == ["some/ckpt"] * len(rules)


def test_ablate_prefill_chunk_reaches_every_evaluation(tmp_path, monkeypatch):
    """`ablate --prefill-chunk N` (a MELT trained with the prompt whole, e.g. the demo's) reaches the evaluation
    options; without it every row keeps the one default rule (exact MELT, chunk 1)."""
    from typer.testing import CliRunner

    import melt_eval.evaluation as evaluation
    from melt_eval.cli import app

    seen = []
    monkeypatch.setattr(evaluation, "run_tasks", lambda tasks, model, opts, *a, **k: seen.append(opts.prefill_chunk) or [])
    monkeypatch.chdir(tmp_path)
    for flags, want in ((["--prefill-chunk", "112"], 112), ([], 1)):
        seen.clear()
        res = CliRunner().invoke(app, ["ablate", "exit", "--preset", "tiny", "--base", "tiny-random-ouro", "--output",
                                       f"r{want}", "--max-steps", "1", "--no-progress", *flags])  # the gate fit: 1 step
        assert seen and set(seen) == {want}, (res.output, seen)
    res = CliRunner().invoke(app, ["ablate", "exit", "--preset", "tiny", "--prefill-chunk", "0", "--dry-run"])
    assert res.exit_code == 2


def _exit_result(root, model, rule, pass1, histogram):
    """A finished results.json as `ablate exit` writes it (results/ablations/exit/<model>/<rule>/synthetic/)."""
    import json

    name = rule.replace(":", "-") if rule else "full"
    settings = {"loops": 4, "kv_sharing": None, "samples": 2, **({"exit": rule} if rule else {})}
    raw = {"model": name, "task": "synthetic", "finished": True, "settings": settings, "model_path": f"/ckpt/{model}",
           "metrics": {"pass@1": {"value": pass1, "stderr": 0.05}}}
    if rule:
        tokens = sum(histogram)
        raw["loops_per_token"] = {"mean": sum((d + 1) * n for d, n in enumerate(histogram)) / tokens,
                                  "histogram": {str(d + 1): n for d, n in enumerate(histogram)}}
    path = root / "ablations" / "exit" / model / name / "synthetic" / "results.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(raw))


def test_the_report_draws_accuracy_against_loops_spent(tmp_path):
    from melt_eval.report.results import load_results
    from melt_eval.report.tables import build_tables
    from melt_eval.report.write import write_report

    for model in ("tiny-random-melt", "tiny-random-ouro"):
        _exit_result(tmp_path, model, None, 0.60, None)
        _exit_result(tmp_path, model, "gate:0.5", 0.40, [10, 10, 0, 0])  # mean 1.5
        _exit_result(tmp_path, model, "agree:1", 0.55, [0, 5, 5, 10])  # mean 3.25
    [table] = [t for t in build_tables(load_results(tmp_path)) if t.key == "exit"]
    assert table.title.startswith("Beyond the paper")
    melt = [(r.stub[2], r.cells[0].value, round(r.cells[1].value, 6)) for r in table.rows if r.stub[0] == "tiny-random-melt"]
    assert melt == [("all loops", 4.0, 60.0), ("gate:0.5", 1.5, 40.0), ("agree:1", 3.25, 55.0)]
    out = write_report(tmp_path, tmp_path / "report", latex=False)
    assert tmp_path / "report" / "plots" / "exit.png" in out["files"]
    assert "Beyond the paper: early exit" in (tmp_path / "report" / "report.md").read_text()
    (tmp_path / "bare").mkdir()  # no --exit runs: no table, no figure
    bare = write_report(tmp_path / "bare", tmp_path / "bare-report", latex=False)
    assert not any(p.name.startswith("exit") for p in bare["files"])
    assert all(t.key != "exit" for t in bare["tables"])


def test_a_compressed_cache_is_not_the_exit_lines_full_depth(tmp_path):
    """The demo's layout: the teacher's exit rows beside its other evaluations (the sharing table's `ouro`, an
    int4-cache row at T = 4, read first); the line is named by its exit folder and its star is the uncompressed run."""
    import json

    from melt_eval.report.results import exit_points, load_results

    _exit_result(tmp_path, "ouro-tiny", "agree:1", 0.55, [0, 5, 5, 10])
    for rel, pass1, extra in (("ablations/kv-sharing/ouro", 0.60, {}),
                              ("ablations/kv-compression/ouro-int4", 0.20, {"kv_cache_dtype": "int4"})):
        path = tmp_path / rel / "synthetic" / "results.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"model": rel.rsplit("/", 1)[1], "finished": True, "model_path": "/ckpt/ouro-tiny",
                                    "settings": {"loops": 4, "kv_sharing": None, "samples": 2, **extra},
                                    "metrics": {"pass@1": {"value": pass1, "stderr": 0.05}}}))
    [(label, points)] = exit_points(load_results(tmp_path)).items()
    assert label == ("ouro-tiny", "synthetic")
    assert [(p.rule, p.result.metrics["pass@1"][0]) for p in points] == [("agree:1", 0.55), (None, 0.60)]


@pytest.mark.parametrize("kind,kv_sharing,share_prompt", [
    ("ouro", None, False), ("ouro", "last", False), ("ouro", "first", True), ("melt", None, False)])
def test_a_rows_exits_do_not_depend_on_its_batch(models, kind, kv_sharing, share_prompt):
    """Every cache layout under agree:1 (rows stop at different loops, so the gathered path runs): each prompt's
    tokens and loop counts batched with another are those it gets alone."""
    options = InferenceOptions(exit="agree:1", kv_sharing=kv_sharing, share_prompt=share_prompt)
    greedy = dict(SAMPLE, n=1, temperature=0.0, max_new_tokens=10)
    together = generate(models[kind], PROMPTS, options, **greedy)
    assert any(c[-1] < sum(c) for per in together.loop_counts for c in per)  # some token stopped early
    for i, prompt in enumerate(PROMPTS):
        alone = generate(models[kind], [prompt], options, **greedy)
        assert alone.sequences[0] == together.sequences[i]
        assert alone.loop_counts[0] == together.loop_counts[i]

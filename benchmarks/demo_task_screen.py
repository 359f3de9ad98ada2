"""Screen a synthetic form for the demo: train the teacher (recipe pretrain-tiny, the form's data) and
measure its pass@1 at T = 1..4 on the form's test split (docs/results/2026-11-26-demo-task-choice.md).

    python benchmarks/demo_task_screen.py --form lookup --max-value 5 --out /tmp/screen-lookup5
    python benchmarks/demo_task_screen.py --form digit-sum3 --seq-len 136 --train-n 8000 --out /tmp/s3 --melt
    python benchmarks/demo_task_screen.py --form digit-sum --seq-len 112 --train-n 1173 --problems 100 \
        --max-steps 800 --lr-schedule-steps 1600 --seed 1 --out /tmp/ds800-s1 --melt

--melt then converts the teacher as the demo does (tiny-phase1, then tiny-phase2, with the form's data)
and scores MELT at each T and the teacher with the untrained KV sharing the demo's baselines use (last
loop, the prompt's cache kept exact: the strongest of them at seeds 0-2 of the digit-sum demo). A run
directory already trained is reused, so --melt can follow a screen that has finished.

Pass@1 here: the share of sampled replies (temperature 1.0, top-p 0.7, the demo's sampling) whose
\\boxed{} answer equals the gold one, by exact string match (the demo scores with LightEval's math
metric; for one-digit answers the two agree). Training prints the load average at the start and end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--form", required=True)
    ap.add_argument("--max-value", type=int, default=9)
    ap.add_argument("--steps", default="5,7")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--train-n", type=int, default=20000)
    ap.add_argument("--max-steps", type=int, default=1600)
    ap.add_argument("--lr-schedule-steps", type=int, default=None,
                    help="the cosine's length when training stops before it ends (recipe lr_schedule_steps)")
    ap.add_argument("--loop-ce-weights", default=None,
                    help="the teacher's weight on each loop's exit, e.g. 0.1,0.2,0.3,0.4 (the recipe's: 0.4,0.3,0.2,0.1)")
    ap.add_argument("--model-overrides", default=None,
                    help='a larger teacher, as JSON config fields, e.g. \'{"hidden_size": 256, "intermediate_size": 512, '
                         '"num_attention_heads": 4, "num_key_value_heads": 4}\' (recipe model_overrides)')
    ap.add_argument("--problems", type=int, default=50)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=96, help="room for the form's longest reply")
    ap.add_argument("--loops", default="1,2,3,4", help="T at inference, in the order evaluated")
    ap.add_argument("--out", required=True)
    ap.add_argument("--melt", action="store_true", help="convert the teacher to MELT as the demo does, and score it")
    ap.add_argument("--save-every", type=int, default=None,
                    help="keep a checkpoint every N steps and score each at --checkpoint-loops (a longer teacher's "
                         "trajectory in one run)")
    ap.add_argument("--checkpoint-loops", default="1,4", help="T at which each kept checkpoint is scored")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    lo, hi = (int(x) for x in a.steps.split(","))
    out = Path(a.out)
    data = [{"source": "synthetic", "n": a.train_n, "num_steps": [lo, hi], "max_value": a.max_value,
             "form": a.form, "target": "solution"}]
    overrides = {"data": data, "seq_len": a.seq_len, "batch_tokens": 16 * a.seq_len, "max_steps": a.max_steps,
                 "save_every": a.save_every or a.max_steps, "lr_schedule_steps": a.lr_schedule_steps,
                 **({"keep_checkpoints": a.max_steps // a.save_every} if a.save_every else {}),
                 **({"seed": a.seed} if a.seed else {}),
                 **({"loop_ce_weights": [float(w) for w in a.loop_ce_weights.split(",")]} if a.loop_ce_weights else {}),
                 **({"model_overrides": json.loads(a.model_overrides)} if a.model_overrides else {})}
    record = {"form": a.form, "max_value": a.max_value, "steps": [lo, hi], "overrides": overrides,
              "load_start": os.getloadavg()}
    started = time.perf_counter()
    if not (out / "train" / "model.safetensors").exists() and not (out / "train" / "config.json").exists():
        from melt_eval.training import run_recipe

        run_recipe("pretrain-tiny", "tiny-random-ouro", out / "train", overrides=overrides, progress=True)
    record["train_s"] = round(time.perf_counter() - started, 1)
    record["load_end_train"] = os.getloadavg()
    if not (out / "screen.json").exists():
        record["pass@1"] = evaluate(out / "train", a)
        record["load_end"] = os.getloadavg()
    else:  # the teacher was screened before: keep its figures
        record = json.loads((out / "screen.json").read_text())
    if a.save_every:
        record["checkpoints"] = score_checkpoints(out / "train", a)
    if a.melt:
        record["melt"] = convert(out, data, a)
    print(json.dumps(record))
    (out / "screen.json").write_text(json.dumps(record, indent=1))


def convert(out: Path, data: list, a) -> dict:
    """MELT from the screened teacher by the demo's two phases (the recipes' steps, the form's data), then
    pass@1 of MELT at each T and of the teacher with the demo's strongest untrained KV sharing."""
    from melt_eval.training import run_recipe

    overrides = {"data": data, "seq_len": a.seq_len, "batch_tokens": 16 * a.seq_len}
    rec: dict = {"load_start": os.getloadavg()}
    for phase, start in (("tiny-phase1", out / "train"), ("tiny-phase2", out / "tiny-phase1")):
        t0 = time.perf_counter()
        if not (out / phase / "config.json").exists():
            run_recipe(phase, str(start), out / phase, overrides=overrides, progress=True)
        rec[f"{phase}_s"] = round(time.perf_counter() - t0, 1)
        rec[f"load_end_{phase}"] = os.getloadavg()
    rec["melt pass@1 (phase 1 only)"] = evaluate(out / "tiny-phase1", a, loops_list="4")
    rec["melt pass@1"] = evaluate(out / "tiny-phase2", a)
    rec["teacher, last loop w/ prefill"] = evaluate(out / "train", a, loops_list="4", kv_sharing="last")
    rec["load_end"] = os.getloadavg()
    return rec


def score_checkpoints(run: Path, a) -> dict:
    """pass@1 of every kept checkpoint (checkpoints/step-N/state) at --checkpoint-loops: its weights beside
    the finished run's config and tokenizer in a scratch directory, scored as the final model is."""
    import shutil

    scores = {}
    for state in sorted(run.glob("checkpoints/step-*/state/model.safetensors")):
        step = int(state.parents[1].name.split("-")[1])
        scratch = run.parent / f"scored-step-{step}"
        if not scratch.exists():
            shutil.copytree(run, scratch, ignore=shutil.ignore_patterns("checkpoints", "logs"))
            shutil.copy(state, scratch / "model.safetensors")
            (scratch / "SHA256SUMS").unlink(missing_ok=True)  # they name the final weights
        scores[step] = evaluate(scratch, a, loops_list=a.checkpoint_loops)
    return scores


def evaluate(checkpoint: Path, a, loops_list: str | None = None, kv_sharing: str | None = None) -> dict:
    from transformers import AutoTokenizer

    from melt_eval import synthetic
    from melt_eval.generation.engine import generate
    from melt_eval.generation.options import InferenceOptions
    from melt_eval.modeling.loading import load_looped

    lo, hi = (int(x) for x in a.steps.split(","))
    rows = synthetic.make_split("test", a.problems, seed=0, num_steps=(lo, hi), max_value=a.max_value, form=a.form)
    model = load_looped(Path(checkpoint)).eval()
    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    prompts = [tok.apply_chat_template([{"role": "user", "content": synthetic.user_prompt(r["problem"])}],
                                       add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
               for r in rows]
    scores = {}
    print(f"{checkpoint}" + (f", kv_sharing {kv_sharing} (the prompt's cache exact)" if kv_sharing else ""), flush=True)
    for loops in (int(t) for t in (loops_list or a.loops).split(",")):
        t0 = time.perf_counter()
        # prompts prefilled whole, as the demo does (its recipes train the prompt as one chunk)
        opts = InferenceOptions(loops=loops, kv_sharing=kv_sharing, prefill_chunk=a.seq_len)
        res = generate(model, prompts, opts, n=a.samples, temperature=1.0, top_p=0.7,
                       max_new_tokens=a.max_new_tokens, seed=0, eos_token_id=tok.eos_token_id)
        right = total = 0
        by_steps: dict[int, list[int]] = {}  # step count -> [right, total]: a chain as long as its cycle leaks
        for i, r in enumerate(rows):
            steps = int(r["solution"].rsplit(": ", 1)[0].rsplit(" ", 1)[-1].rstrip(":")) if ": " in r["solution"] else 0
            for seq in res.sequences[i]:
                m = re.search(r"\\boxed\{([^{}]*)\}", tok.decode(seq, skip_special_tokens=True))
                ok = bool(m and m[1].strip() == r["answer"])
                right, total = right + ok, total + 1
                counts = by_steps.setdefault(steps, [0, 0])
                counts[0] += ok
                counts[1] += 1
        scores[f"T={loops}"] = round(right / total, 4)
        scores[f"T={loops} by steps"] = {k: round(v[0] / v[1], 4) for k, v in sorted(by_steps.items())}
        print(f"T={loops}: pass@1 {scores[f'T={loops}']:.3f}, by step count {scores[f'T={loops} by steps']} "
              f"({time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.1f})", flush=True)
    return scores


if __name__ == "__main__":
    main()

"""The demo's two speed-ups against the code before them, measured in one run on the demo's shapes.

1. Training: a tiny-phase1 step (16 synthetic chats, chunk 1, one thread) with the prompt chunked like
   the reply (`prompt_as_one_chunk: false`, the recipe before) and as one chunk (the recipe now), the two
   alternating, `--rounds` times each; the median step of each.
2. Evaluation: the native engine generating 16 samples (temperature 1.0, top-p 0.7) for `--problems`
   synthetic prompts with a MELT model of the demo's size: the prompt prefilled one token at a time and
   each row sampled by `torch.multinomial` with its own generator (the engine before, kept here as the
   baseline), then the prompt whole with the same sampler, then the prompt whole with `sample_next`
   (inverse transform of per-row uniforms drawn once per wave, the engine now).

    python benchmarks/demo_speedups.py [--steps 6] [--rounds 2] [--problems 100] [--sequences 16] [--json]

Random weights (tiny-random-ouro and MELT from it): a random model never stops, so every variant
generates the same number of tokens. Ratios are what carry over; the load average is printed beside them.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _args import Parser, whole  # noqa: E402


def training_steps(steps: int, rounds: int, sequences: int = 16) -> dict[str, float]:
    from melt_eval.training import load_recipe, run_recipe

    seq_len = load_recipe("tiny-phase1").seq_len

    times: dict[str, list[float]] = {"prompt chunked like the reply": [], "prompt as one chunk": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for label, whole in (("prompt chunked like the reply", False), ("prompt as one chunk", True)):
                out = Path(tmp) / f"{r}-{whole}"
                run_recipe("tiny-phase1", "tiny-random-ouro", out, progress=False,
                           overrides={"prompt_as_one_chunk": whole, "max_steps": steps + 2, "interpolation_steps": 0,
                                      "save_every": 0, "tensorboard": False, "micro_batch_size": sequences,
                                      "batch_tokens": sequences * seq_len})
                rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
                times[label] += [row["step_time_s"] for row in rows[2:]]  # the first two steps warm up
    return {label: statistics.median(t) for label, t in times.items()}


def demo_sized_melt_and_prompts(problems: int):
    """A MELT model of the demo's size (random weights: it never stops, so every run generates the same number
    of tokens), `problems` synthetic prompts as the demo's task words them, and the recipe's sequence length."""
    import torch

    from melt_eval.modeling import MeltForCausalLM
    from melt_eval.modeling.loading import load_model
    from melt_eval.training.config import load_recipe
    from melt_eval.training.data import DataStream, prompt_length

    looplm, tokenizer = load_model("tiny-random-ouro")
    model = MeltForCausalLM.from_looplm(looplm, gate="elementwise", seed=0).eval()
    recipe = load_recipe("tiny-phase1")
    stream = DataStream(recipe.data, tokenizer, recipe.seq_len, seed=0)
    prompts = []
    for _ in range(problems):
        example = stream.next()
        prompts.append(example.input_ids[: prompt_length(torch.tensor([example.loss_mask]))])
    return model, prompts, recipe.seq_len


def generation(problems: int) -> dict[str, float]:
    import torch

    import melt_eval.generation.engine as engine
    from melt_eval.generation.options import InferenceOptions

    model, prompts, seq_len = demo_sized_melt_and_prompts(problems)

    def per_row_multinomial(logits, temperature, top_p, uniforms):
        """The engine's sampler before: the same nucleus, then one multinomial per row's generator."""
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        return torch.stack([torch.multinomial(p, 1, generator=g)[0] for p, g in zip(probs, generators)])

    generators = [torch.Generator().manual_seed(r) for r in range(problems * 16)]
    current = engine.sample_next
    times = {}
    for label, chunk, sampler in (("prefill chunk 1, per-row multinomial", 1, per_row_multinomial),
                                  ("whole prompt, per-row multinomial", seq_len, per_row_multinomial),
                                  ("whole prompt, sample_next", seq_len, current)):
        engine.sample_next = sampler
        try:
            t0 = time.perf_counter()
            engine.generate(model, prompts, InferenceOptions(prefill_chunk=chunk), n=16, temperature=1.0, top_p=0.7,
                            max_new_tokens=96, seed=0)
            times[label] = time.perf_counter() - t0
        finally:
            engine.sample_next = current
    return times


def main(argv=None) -> dict:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=whole(1), default=6, help="timed training steps per round and variant")
    ap.add_argument("--rounds", type=whole(1), default=2)
    ap.add_argument("--problems", type=whole(1), default=100)
    ap.add_argument("--sequences", type=whole(1), default=16, help="chats per training step (the recipe's 16)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)  # as the demo's side-by-side workers
    load = [round(x, 2) for x in os.getloadavg()]
    train = training_steps(args.steps, args.rounds, args.sequences)
    gen = generation(args.problems)
    out = {"training_step_s": {k: round(v, 3) for k, v in train.items()},
           "generation_s": {k: round(v, 2) for k, v in gen.items()},
           "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, one torch thread",
           "load_average": {"start": load, "end": [round(x, 2) for x in os.getloadavg()]}}
    if args.json:
        print(json.dumps(out))
        return out
    print(f"{out['machine']}; load average {load[0]} at the start, {out['load_average']['end'][0]} at the end")
    base = train["prompt chunked like the reply"]
    print(f"tiny-phase1 step of {args.sequences} chats (median):")
    for label, t in train.items():
        print(f"  {label:<40} {t:.3f} s  ({t / base:.2f}x)")
    base = gen["prefill chunk 1, per-row multinomial"]
    print(f"generation, {args.problems} prompts x 16 samples, 96 new tokens:")
    for label, t in gen.items():
        print(f"  {label:<40} {t:.2f} s  ({t / base:.2f}x)")
    return out


if __name__ == "__main__":
    main()

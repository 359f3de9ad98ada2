"""Whether a change moves the training step's arithmetic: the student's weights after three phase-1 steps, saved
at one version of the code and compared bit for bit with another's (issue 49: a change that only cuts kernel
launches must leave the eager step, which the demo trains with, as it was; one that does not needs the demo's
figures checked again).

    python benchmarks/same_bits.py save before.pt [--compile]    # at the old commit
    python benchmarks/same_bits.py save after.pt [--compile]     # at the new one
    python benchmarks/same_bits.py compare before.pt after.pt    # exit status 1 when any tensor differs

The steps are `benchmarks/dispatch.py`'s phase-1 set-up at 2 layers: chunk 16, bf16 autocast over fp32 weights,
the bf16 teacher, AdamW as `melt-eval train` builds it, at 48, 64 and 80 tokens. `--compile` takes the
compiled layer step instead (`compile: true`), whose bits follow inductor's fusions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dispatch  # noqa: E402
from _args import Parser, input_file, output_file  # noqa: E402

STEPS = (3, 4, 5)  # chunks per step


def trained_weights(compiled: bool) -> dict[str, torch.Tensor]:
    student, teacher, recipe = dispatch.build(2)
    if compiled:
        torch._dynamo.reset()
        student.model.compile_layer_step()
    optimizer = dispatch.make_optimizer(student, recipe)
    dispatch.allocate_optimizer_state(optimizer)
    for chunks in STEPS:
        dispatch.one_step(student, teacher, optimizer, recipe, chunks * dispatch.CHUNK, None)
    return {name: t.detach().clone() for name, t in student.state_dict().items()}


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict:
    if a.keys() != b.keys():
        return {"tensors": len(a), "different": None, "names_differ": sorted(set(a) ^ set(b))}
    diff = {name: float((a[name].double() - b[name].double()).abs().max()) for name in a if not torch.equal(a[name], b[name])}
    largest = dict(sorted(diff.items(), key=lambda kv: -kv[1])[:5])
    return {"tensors": len(a), "different": len(diff), "largest_abs_differences": largest}


def main(argv=None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    save = sub.add_parser("save", help="train three steps and save the weights")
    save.add_argument("path", type=output_file)
    save.add_argument("--compile", action="store_true", help="the compiled layer step (compile: true)")
    cmp = sub.add_parser("compare", help="compare two saved sets of weights bit for bit")
    cmp.add_argument("a", type=input_file)
    cmp.add_argument("b", type=input_file)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the kernels split their work by threads: one thread makes two runs comparable
    if args.command == "save":
        torch.save(trained_weights(args.compile), args.path)
        print(f"saved {args.path}")
        return 0
    weights = []
    for path in (args.a, args.b):
        try:
            loaded = torch.load(path)
        except Exception:  # noqa: BLE001 - whatever torch makes of a file that is not one: the same one line
            loaded = None
        if not (isinstance(loaded, dict) and all(isinstance(t, torch.Tensor) for t in loaded.values())):
            parser.error(f"{path} holds no weights saved by `same_bits.py save`")
        weights.append(loaded)
    result = compare(*weights)
    print(json.dumps(result, indent=2))
    return 0 if result["different"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

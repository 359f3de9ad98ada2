"""Each teacher's per-loop reply loss, and that of MELT made from it before any training (element-wise gate at its
initialisation, alpha = 1, chunk 1 with the prompt as one chunk, as phase 1 ends its interpolation)."""
import json, sys
import torch
from melt_eval.experiments.loop_profile import loop_profile, reply_batch
from melt_eval.modeling import load_model, MeltForCausalLM
from melt_eval.training.data import prompt_length

torch.manual_seed(0)
out = {}
for spec in sys.argv[1:]:
    name, path, gate_seed = spec.split(":")
    teacher, tok = load_model(path); teacher.eval()
    batch = reply_batch(tok, "tiny-phase1", 48, 123)
    fc = prompt_length(batch["loss_mask"])
    melt = MeltForCausalLM.from_looplm(teacher, gate="elementwise", seed=int(gate_seed)); melt.eval()
    t, m = loop_profile(teacher, batch), loop_profile(melt, batch, fc)
    out[name] = {"teacher": [r["reply_loss"] for r in t], "melt_untrained": [r["reply_loss"] for r in m],
                 "melt_untrained_greedy_error": [r["greedy_error"] for r in m]}
    print(name, "teacher", [round(x, 4) for x in out[name]["teacher"]], "MELT before training",
          [round(x, 3) for x in out[name]["melt_untrained"]], flush=True)
json.dump(out, open("/tmp/exp2/conv.json", "w"), indent=1)

"""How far each loop's keys and values move from the last loop's, per layer, in a LoopLM teacher:
||kv_t - kv_T|| / ||kv_T|| over the real tokens of 48 training chats (the loop profile's batch), keys before
RoPE (a rotation per position, so distances are the same after it). A shared cache keeps one entry per token
for all loops; the further a teacher's loops move their entries, the more that one entry has to stand for."""
import json, sys
import torch
from melt_eval.experiments.loop_profile import reply_batch
from melt_eval.modeling import load_model

out = {}
for spec in sys.argv[1:]:
    name, path = spec.split(":", 1)
    model, tok = load_model(path); model.eval()
    batch = reply_batch(tok, "tiny-phase1", 48, 123)
    real = batch["attention_mask"].bool()
    calls = {}
    hooks = [layer.self_attn.kv_proj.register_forward_hook(lambda m, i, o, n=n: calls.setdefault(n, []).append(o.detach()))
             for n, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(batch["input_ids"], attention_mask=batch["attention_mask"])
    for h in hooks:
        h.remove()
    rows = {}
    for n, per_loop in calls.items():
        half = per_loop[0].shape[-1] // 2
        last = per_loop[-1]
        for what, sl in (("k", slice(0, half)), ("v", slice(half, None))):
            ref = last[..., sl]
            rows[f"layer{n}.{what}"] = [round(((kv[..., sl] - ref).norm(dim=-1) / ref.norm(dim=-1))[real].mean().item(), 4)
                                        for kv in per_loop]
    out[name] = rows
    print(name, {k: v[:-1] for k, v in rows.items()}, flush=True)
json.dump(out, open(sys.stdout.fileno() if False else "/tmp/exp2/kvdrift.json", "w"), indent=1)

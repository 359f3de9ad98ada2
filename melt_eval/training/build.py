"""The student, the teacher, the optimiser and the data stream a recipe trains with.

Every mismatch a run can know before its first step (a teacher of another shape, a phase-2 run from
a LoopLM, one loop weight too many) is refused here, before any compute: a run that would fail or
learn the wrong thing hours in must not start.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from accelerate.utils import DistributedType

from melt_eval.errors import UserError
from melt_eval.training.config import Recipe
from melt_eval.training.data import DataStream
from melt_eval.training.run_files import read_meta
from melt_eval.training.step import Trainee

SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "total_ut_steps")


def _pooled_from(student, teacher) -> bool:
    """Whether the student's key/value heads can be the teacher's pooled in groups (grouped-query MELT):
    then their kv_proj shapes differ by design and the teacher still teaches (its outputs are what KD reads)."""
    s, t = student.config.num_key_value_heads, teacher.config.num_key_value_heads
    return isinstance(s, int) and isinstance(t, int) and s < t and t % s == 0


def check_teacher(student, teacher) -> None:
    """Refuse a teacher whose architecture differs from the student's (before any compute)."""
    pooled = _pooled_from(student, teacher)
    fields = [k for k in SHAPE_FIELDS if not (pooled and k == "num_key_value_heads")]
    bad = [f"{k}: student {getattr(student.config, k, None)} vs teacher {getattr(teacher.config, k, None)}"
           for k in fields if getattr(student.config, k, None) != getattr(teacher.config, k, None)]
    t_shapes = {k: v.shape for k, v in teacher.state_dict().items()}
    kv = "self_attn.kv_proj.weight"
    bad += [f"{k}: student {tuple(v.shape)} vs teacher {tuple(t_shapes[k])}"
            for k, v in student.state_dict().items()
            if k in t_shapes and t_shapes[k] != v.shape and not (pooled and k.endswith(kv))][:5]
    if bad:
        raise UserError("the teacher does not match the student (" + "; ".join(bad) + "); pass the LoopLM the student was made from with --teacher")


def recorded_teacher(model_dir: Path) -> str | None:
    """The teacher the run that trained `model_dir` recorded, if it recorded one."""
    meta = read_meta(model_dir)
    return meta.get("teacher") if isinstance(meta, dict) else None


def build_models(recipe: Recipe, verify: bool = True):
    """(student, teacher or None, tokenizer, provenance dict) for the recipe. verify: check checkpoint
    directories (--from, the teacher) against their SHA256SUMS (False: `train --no-verify`)."""
    from melt_eval.modeling import LoopLMConfig, LoopLMForCausalLM, MeltForCausalLM, load_model
    from melt_eval.modeling.loading import (check_config_size, checkpoint_model_type, load_tokenizer,
                                            resolve_model_dir)

    if not recipe.from_model:
        raise UserError("no starting model: pass --from MODEL (a registry name or checkpoint directory)")
    from_dir = resolve_model_dir(recipe.from_model, verify=verify)
    info = {"from_model": recipe.from_model, "from_path": str(from_dir), "checksums_checked": verify}
    kind = checkpoint_model_type(from_dir)

    if recipe.target == "exit_gate":
        return _gate_model(recipe, from_dir, kind, info, verify)
    if recipe.target == "looplm":
        if kind != "ouro":
            raise UserError(f"target looplm trains an Ouro-style LoopLM; {recipe.from_model} is {kind!r}")
        if recipe.from_scratch:  # a fresh LoopLM with the architecture (and tokenizer) of from_model
            config = LoopLMConfig.from_pretrained(from_dir)
            for key, value in recipe.model_overrides.items():
                if not hasattr(config, key):
                    raise UserError(f"model_overrides: {key!r} is not a LoopLM config field")
                setattr(config, key, value)
            check_config_size(f"{recipe.from_model} with model_overrides {recipe.model_overrides}", config.to_dict())
            torch.manual_seed(recipe.seed)
            student = LoopLMForCausalLM(config)
            tokenizer = load_tokenizer(from_dir)
        else:
            if recipe.model_overrides:
                raise UserError("model_overrides only apply with from_scratch: true")
            student, tokenizer = load_model(from_dir, verify=verify)
        return student, None, tokenizer, info

    if recipe.from_scratch or recipe.model_overrides:
        raise UserError("from_scratch/model_overrides are for target looplm; MELT starts from a trained model")
    _check_melt_start(recipe, from_dir, kind)
    model, tokenizer = load_model(from_dir, verify=verify)
    teacher = None
    teacher_ref = recipe.teacher
    if isinstance(model, MeltForCausalLM):
        if teacher_ref is None:
            teacher_ref = recorded_teacher(from_dir)
        student = model
        if model.config.gate != recipe.gate:
            info["gate_note"] = f"continuing the checkpoint's {model.config.gate!r} gate (recipe gate {recipe.gate!r} ignored)"
    else:
        student = _convert(model, recipe)
        if teacher_ref is None:
            teacher_ref, teacher = recipe.from_model, model  # the frozen copy of the starting LoopLM
            info["teacher_path"] = str(from_dir)
            # until its first update, at alpha = 0, the student computes its teacher's function (unpooled heads)
            info["student_is_teacher"] = student.config.num_key_value_heads == model.config.num_key_value_heads
    if recipe.needs_teacher() and teacher is None:
        teacher_dir = resolve_model_dir(teacher_ref, verify=verify)
        if checkpoint_model_type(teacher_dir) != "ouro":
            raise UserError(f"the teacher must be a LoopLM (Ouro) checkpoint; {teacher_ref} is {checkpoint_model_type(teacher_dir)!r}")
        teacher, _ = load_model(teacher_dir, verify=verify)
        info["teacher_path"] = str(teacher_dir)
    # a checkpoint directory is recorded absolute: a run continued from elsewhere (phase 2, exit-aware training of
    # the demo's relative demo/runs/...) finds the same teacher; registry names and Hub ids stay as given
    info["teacher"] = str(Path(teacher_ref).resolve()) if teacher_ref and Path(teacher_ref).is_dir() else teacher_ref
    if teacher is not None:
        check_teacher(student, teacher)
        teacher.eval().requires_grad_(False)
    elif model is not student:
        del model  # no KD and no alignment: the starting LoopLM is not needed any more
    return student, teacher, tokenizer, info


def _gate_model(recipe: Recipe, from_dir: Path, kind: str, info: dict, verify: bool = True):
    """target exit_gate: the checkpoint as it is, whichever looped kind; no teacher. The record keeps the
    checkpoint's own recipe (`model_recipe`: `run` reads its prompt chunk there) and teacher (a later phase 2)."""
    from melt_eval.modeling import load_model

    if kind not in ("ouro", "melt"):
        raise UserError(f"target exit_gate fits the early-exit gate of a looped model (Ouro or MELT); "
                        f"{recipe.from_model} is {kind!r}")
    model, tokenizer = load_model(from_dir, verify=verify)
    meta = read_meta(from_dir)
    meta = meta if isinstance(meta, dict) else {}
    info.update(teacher=meta.get("teacher"), teacher_path=meta.get("teacher_path"),
                model_recipe=meta.get("model_recipe") or meta.get("recipe"))
    return model, None, tokenizer, info


def _check_melt_start(recipe: Recipe, from_dir: Path, kind: str) -> None:
    """What config.json and the run's record say about a MELT target's start, refused before any weight loads."""
    from melt_eval.modeling.loading import read_config

    if kind != "melt" and recipe.phase == 2:
        raise UserError(f"phase 2 continues a phase-1 MELT checkpoint; {recipe.from_model} is a LoopLM (run phase 1 first)")
    if kind == "melt" and recipe.teacher is None and recorded_teacher(from_dir) is None and recipe.needs_teacher():
        raise UserError(f"{recipe.from_model} is a MELT checkpoint with no recorded teacher; pass --teacher <the original LoopLM>")
    if recipe.kv_heads is None:
        return
    config = read_config(from_dir)
    heads = config.get("num_key_value_heads") or config.get("num_attention_heads")
    if kind == "melt":  # its heads were pooled at conversion: kv_heads can only name what it has
        if recipe.kv_heads != heads:
            raise UserError(f"kv_heads: {recipe.kv_heads} pools a LoopLM's heads when converting it (phase 1); "
                            f"{recipe.from_model} is a MELT checkpoint with {heads} key/value heads")
    elif isinstance(heads, int) and not isinstance(heads, bool) and heads >= 1:  # else the loaders say what is wrong
        _check_kv_heads(SimpleNamespace(num_key_value_heads=heads, num_attention_heads=config.get("num_attention_heads")),
                        recipe)


def _convert(looplm, recipe: Recipe):
    """The LoopLM as MELT with the recipe's gate, its key/value heads pooled to `kv_heads` if set."""
    from melt_eval.modeling import MeltForCausalLM

    if recipe.kv_heads is not None:
        _check_kv_heads(looplm.config, recipe)
    return MeltForCausalLM.from_looplm(looplm, gate=recipe.gate, seed=recipe.gate_seed, ema_decay=recipe.ema_decay,
                                       kv_heads=recipe.kv_heads)


def _check_kv_heads(config, recipe: Recipe) -> None:
    """kv_heads must divide the LoopLM's key/value heads: one line naming the model."""
    from melt_eval.modeling.melt import check_kv_heads

    try:
        check_kv_heads(config, recipe.kv_heads)
    except ValueError as exc:
        raise UserError(f"{exc} ({recipe.from_model})") from None


def param_groups(model, recipe: Recipe) -> list[dict]:
    """Two groups: MELT's gate parameters at gate_lr, everything else at lr."""
    gate = [p for p in model.gate_parameters() if p.requires_grad] if hasattr(model, "gate_parameters") else []
    gate_ids = {id(p) for p in gate}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in gate_ids]
    groups = [{"params": rest, "lr": recipe.lr, "base_lr": recipe.lr, "name": "base"}]
    if gate:
        groups.append({"params": gate, "lr": recipe.gate_lr, "base_lr": recipe.gate_lr, "name": "gate"})
    return groups


def make_optimizer(model, recipe: Recipe, device: torch.device | str | None = None) -> torch.optim.Optimizer:
    """AdamW over `param_groups` with the recipe's betas, eps and weight decay, on the device the parameters will
    train on (default: where they are now): fused where torch has the fused kernel (CUDA, the CPU: one kernel per
    group for the whole update), else `foreach`; either way a few ops per group instead of about ten per parameter
    (a step is bound by kernel launches)."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    device = torch.device(device) if device is not None else next(model.parameters()).device
    fast = {"fused": True} if device.type in _get_fused_kernels_supported_devices() else {"foreach": True}
    return torch.optim.AdamW(
        param_groups(model, recipe), betas=tuple(recipe.adam_betas), eps=recipe.adam_eps, weight_decay=recipe.weight_decay,
        **fast,
    )


def allocate_optimizer_state(optimizer) -> None:
    """Build AdamW's state of every parameter now, as its first step would (step 0, zero moments), so the step
    allocates nothing: an out-of-memory error inside `step()` can no longer leave a parameter's state half-built
    (its `exp_avg` without `exp_avg_sq`, a KeyError at the next step). Call it where the parameters train (after
    `accelerator.prepare`); a resumed run's `load_state_dict` replaces it."""
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer wraps it
    for group in inner.param_groups:
        on_device = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            state = inner.state[p]
            if state:
                continue
            # where and in which dtype AdamW's own lazy initialisation puts the step count
            on_cpu_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
            state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if on_device
                             else torch.tensor(0.0, dtype=on_cpu_dtype))
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def prepare_student(student, recipe: Recipe, one_process: bool = True) -> int:
    """Put the student in training mode as the recipe asks; returns the row padding multiple.

    one_process: no DDP or FSDP wraps the model, so the compiled layer step may add the weights' gradients
    into .grad itself (`compile_layer_step(grads_in_place=True)`); DDP and FSDP reduce gradients from hooks on
    autograd's accumulation, which that path bypasses."""
    # Ouro's early-exit gate is trained only by target exit_gate (the objective of the others never reads it):
    # frozen otherwise, so that DDP/FSDP see no parameter without a gradient. Under exit_gate it is all that trains.
    if recipe.target == "exit_gate":
        student.requires_grad_(False)
        student.model.early_exit_gate.requires_grad_(True)
        student.eval()  # nothing of the model itself is trained: no dropout, as it runs at inference
        return 1
    student.model.early_exit_gate.requires_grad_(False)
    student.train()
    if recipe.gradient_checkpointing:
        student.gradient_checkpointing_enable()
    per_token = recipe.compile is True and recipe.target == "melt" and recipe.chunk_size == 1
    if recipe.compile == "captured":
        if not one_process:
            from melt_eval.training.launch import CAPTURED_WITH_SEVERAL

            raise UserError(CAPTURED_WITH_SEVERAL)
        student.model.compile_captured_step()
    elif per_token:  # one compiled function per token: every token has the same shapes
        student.model.compile_token_step()
    elif recipe.compile:
        student.model.compile_layer_step(grads_in_place=one_process)
    # a compiled layer step recompiles for every new chunk shape: pad rows to whole chunks
    return recipe.chunk_size if recipe.compile and recipe.chunk_size and not per_token else 1


def prepare_training(accelerator, recipe: Recipe, mixed_precision: str, verify: bool = True) -> tuple[Trainee, object, dict]:
    """(what each step works on, the tokenizer, build_models' provenance) on this process."""
    with accelerator.main_process_first():  # rank 0 builds a registry model the first time; the others then read it
        student, teacher, tokenizer, info = build_models(recipe, verify)
    loops = student.config.total_ut_steps
    if recipe.loop_ce_weights and len(recipe.loop_ce_weights) != loops:
        raise UserError(f"loop_ce_weights has {len(recipe.loop_ce_weights)} weights; {recipe.from_model} runs "
                        f"T = {loops} loops: give one weight per loop")
    if recipe.target == "exit_gate" and loops < 2:
        raise UserError(f"target exit_gate fits when to stop looping; {recipe.from_model} runs T = {loops} loop")
    if accelerator.is_main_process and info.get("gate_note"):
        accelerator.print(f"note: {info['gate_note']}")
    pad_multiple = prepare_student(student, recipe, one_process=accelerator.distributed_type == DistributedType.NO)
    optimizer = make_optimizer(student, recipe, accelerator.device)
    model, optimizer = accelerator.prepare(student, optimizer)
    allocate_optimizer_state(optimizer)
    if teacher is not None:
        teacher.to(accelerator.device, dtype=torch.bfloat16 if mixed_precision == "bf16" else torch.float32)

    world = accelerator.num_processes
    stream = DataStream(recipe.data, tokenizer, recipe.seq_len, seed=recipe.seed, shuffle_buffer=recipe.shuffle_buffer,
                        rank=accelerator.process_index, world_size=world, overlong=recipe.overlong)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    learned_gate = any(True for _ in student.gate_parameters()) if hasattr(student, "gate_parameters") else False
    trainee = Trainee(accelerator=accelerator, model=model, optimizer=optimizer, teacher=teacher, stream=stream,
                      recipe=recipe, world=world, accum=recipe.grad_accum_steps(world), pad_id=pad_id,
                      pad_multiple=pad_multiple, learned_gate=learned_gate,
                      student_is_teacher=bool(info.pop("student_is_teacher", False)))
    return trainee, tokenizer, info

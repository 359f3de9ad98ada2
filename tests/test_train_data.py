"""Training data: the synthetic task, chat rendering with assistant-only loss, sources, resumable order."""

import json

import pytest

from melt_eval.errors import UserError
from melt_eval.modeling.tiny import build_tokenizer
from melt_eval import synthetic
from melt_eval.training.data import DataStream, collate, encode_chat, prompt_length, to_messages


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_synthetic_splits_are_deterministic_disjoint_and_correct():
    a = synthetic.make_split("train", 300, seed=0, num_steps=(1, 3))
    assert a == synthetic.make_split("train", 300, seed=0, num_steps=(1, 3))
    assert a != synthetic.make_split("train", 300, seed=1, num_steps=(1, 3))
    test = synthetic.make_split("test", 100, seed=0, num_steps=(1, 3))
    assert not {x["problem"] for x in a} & {x["problem"] for x in test}
    assert len({x["problem"] for x in a}) == 300
    for item in a + test:
        env = {}
        for stmt in item["problem"].split(". ")[:-1]:  # "a = 7", "b = a + 5", ...
            name, expr = stmt.split(" = ")
            env[name] = eval(expr, {}, env)
        asked = item["problem"].rsplit("What is ", 1)[1].rstrip("?")
        assert str(env[asked]) == item["answer"]
        assert item["solution"].endswith(f"\\boxed{{{item['answer']}}}.")
    with pytest.raises(ValueError, match="distinct"):
        synthetic.make_split("test", 50, num_steps=1, max_value=3)


def test_digit_chains_are_correct_and_their_worked_reply_dominates(tok):
    """form "digits": the worked reply is mostly the sequence (>= 3x the prompt with its template, as the
    paper's generated reasoning is), every step's last digit is right, and the splits stay disjoint."""
    train = synthetic.make_split("train", 300, seed=0, num_steps=(5, 9), form="digits")
    test = synthetic.make_split("test", 90, seed=0, num_steps=(5, 9), form="digits")
    assert train == synthetic.make_split("train", 300, seed=0, num_steps=(5, 9), form="digits")
    assert not {x["problem"] for x in train} & {x["problem"] for x in test}
    ratios = []
    for item in train + test:
        start, rest = item["problem"].removeprefix("x = ").split(". ", 1)
        count, _, _, _, _, _, op, step = rest.split(" ")[:8]
        value, steps = int(start), item["solution"].split(". ")
        for i in range(1, int(count) + 1):
            value = (value + int(step) if op == "+" else value - int(step)) % 10
            assert steps[i - 1].endswith(f"= {value}"), (item, i)
        assert item["answer"] == str(value) and item["solution"].endswith(f"\\boxed{{{value}}}.")
        prompt = tok.apply_chat_template(synthetic.to_messages(item, "solution")[:1], add_generation_prompt=True,
                                         return_dict=True)["input_ids"]
        ratios.append(len(tok(item["solution"])["input_ids"]) / len(prompt))
    assert sum(ratios) / len(ratios) >= 3.0, sum(ratios) / len(ratios)
    with pytest.raises(ValueError, match="form"):
        synthetic.make_split("test", 5, form="words")
    s = DataStream([{"source": "synthetic", "n": 20, "num_steps": [5, 9], "form": "digits", "target": "solution"}],
                   tok, 160, seed=0)
    assert "step each x = x" in tok.decode(s.next().input_ids)


def test_digit_sum_chains_are_correct_one_token_per_value_and_their_reply_dominates(tok):
    """form "digit-sum": every value is a digit 1..9 written as one token (so each step has the same
    length), every step's digit sum is right, every reply is >= 3x its prompt with the template, and
    the test split is large enough for the demo (90 problems) and disjoint from train."""
    train = synthetic.make_split("train", 1000, seed=0, num_steps=(5, 7), form="digit-sum")
    test = synthetic.make_split("test", 90, seed=0, num_steps=(5, 7), form="digit-sum")
    assert not {x["problem"] for x in train} & {x["problem"] for x in test}
    for item in train + test:
        name, start, count, _, _, _, step, _ = item["problem"].replace(".", "").replace(" = ", " ").split(" ")
        value, steps = int(start), item["solution"].split(". ")
        for i in range(1, int(count) + 1):
            value = (value + int(step) - 1) % 9 + 1
            assert steps[i - 1] == f"{i}: {name} = {(value - int(step) - 1) % 9 + 1} + {step} = {value}", (item, i)
            assert len(tok(steps[i - 1] + ".")["input_ids"]) == 10, steps[i - 1]
        assert item["answer"] == str(value) and item["solution"].endswith(f"\\boxed{{{value}}}.")
        prompt = tok.apply_chat_template(synthetic.to_messages(item, "solution")[:1], add_generation_prompt=True,
                                         return_dict=True)["input_ids"]
        assert len(tok(item["solution"])["input_ids"]) >= 3 * len(prompt), item


@pytest.mark.parametrize("form,constants", [("digit-sum2", 2), ("digit-sum3", 3)])
def test_digit_sum_chains_with_several_constants_add_them_all_in_each_step(tok, form, constants):
    """forms "digit-sum2"/"digit-sum3" (issue 39): each step adds two or three constants at once, every value
    a one-token digit (each step 2 tokens longer per constant), the digit sum right, never a chain that stands
    still (constants summing to a multiple of 9), the reply >= 3x its prompt, the splits disjoint, and the
    mistake table reads their replies as it reads the one-constant chains'."""
    kw = dict(seed=0, num_steps=(5, 7), form=form)
    train, test = synthetic.make_split("train", 1000, **kw), synthetic.make_split("test", 100, **kw)
    assert train == synthetic.make_split("train", 1000, **kw) and train != synthetic.make_split("train", 1000, **{**kw, "seed": 1})
    assert not {x["problem"] for x in train} & {x["problem"] for x in test}
    for item in train + test:
        head, rule = item["problem"].rstrip(".").split(". ")  # "y = 7", "6 step y + 4 + 5 sum"
        name, start = head.split(" = ")
        count, _, name2, *added, _ = rule.split(" ")
        consts = [int(c) for c in added if c != "+"]
        assert name == name2 and len(consts) == constants and all(1 <= c <= 8 for c in consts) and sum(consts) % 9
        value, steps = int(start), item["solution"].split(". ")
        for i in range(1, int(count) + 1):
            new = value + sum(consts)
            while new > 9:  # the digit sum, worked out digit by digit
                new = sum(int(d) for d in str(new))
            assert steps[i - 1] == f"{i}: {name} = {value} + {' + '.join(map(str, consts))} = {new}", (item, i)
            assert len(tok(steps[i - 1] + ".")["input_ids"]) == 10 + 2 * (constants - 1), steps[i - 1]
            value = new
        assert item["answer"] == str(value) and item["solution"].endswith(f"\\boxed{{{value}}}.")
        prompt = tok.apply_chat_template(synthetic.to_messages(item, "solution")[:1], add_generation_prompt=True,
                                         return_dict=True)["input_ids"]
        assert len(tok(item["solution"])["input_ids"]) >= 3 * len(prompt), item
        assert synthetic.first_mistake(item, item["solution"]) is None
    right = "1: y = 7 + 6 + 4 = 8. 2: y = 8 + 6 + 4 = 9. The answer is \\boxed{9}."  # 17 -> 8, 18 -> 9
    item = {"problem": "y = 7. 2 step y + 6 + 4 sum.", "answer": "9"}
    assert synthetic.first_mistake(item, right) is None
    assert synthetic.first_mistake(item, right.replace("= 9.", "= 1.")) == (2, "sum")
    assert synthetic.first_mistake(item, right.replace("7 + 6 + 4", "7 + 6")) == (1, "copy")


@pytest.mark.parametrize("form,max_value,num_steps", [("lookup", 9, (5, 7)), ("lookup", 7, (3, 5)), ("lookup2", 8, (4, 6))])
def test_lookup_chains_are_correct_one_token_per_value_and_need_two_lookups_a_step(tok, form, max_value, num_steps):
    """forms "lookup" (y -> p(p(y))) and "lookup2" (y -> f(p(y))): the tables in the prompt are permutations of
    1..max_value whose composite is one cycle through every value (no fixed point or short loop to copy
    within the chain), every step applies them to the previous result without writing the value in
    between, every value is one token (each step 10 tokens), the chain never comes back to a value it has
    seen, 5-7 steps make the reply longer than its prompt, and the splits are deterministic and disjoint."""
    kw = dict(seed=0, num_steps=num_steps, max_value=max_value, form=form)
    train, test = synthetic.make_split("train", 1000, **kw), synthetic.make_split("test", 100, **kw)
    assert train == synthetic.make_split("train", 1000, **kw) and train != synthetic.make_split("train", 1000, **{**kw, "seed": 1})
    assert not {x["problem"] for x in train} & {x["problem"] for x in test}
    digits = {tok(f" {d}")["input_ids"][0] for d in range(1, 10)}
    assert len(digits) == 9 and all(len(tok(f" {d}")["input_ids"]) == 1 for d in range(1, 10))
    ratios = []
    for item in train + test:
        *defs, start, rule = item["problem"].rstrip(".").split(". ")
        tables = {}
        for d in defs:  # "p = 3 5, 1 2, ..." read independently of the generator
            name, entries = d.split(" = ")
            pairs = [tuple(int(v) for v in e.split(" ")) for e in entries.split(", ")]
            tables[name] = dict(pairs)
            assert sorted(tables[name]) == sorted(tables[name].values()) == list(range(1, max_value + 1))
        var, value = start.split(" = ")
        count, _, var2, _, *names, var3 = rule.split(" ")
        assert var == var2 == var3 and "".join(names) == {"lookup": "pp", "lookup2": "fp"}[form]
        value, seen, steps = int(value), [], item["solution"].split(". ")
        for i in range(1, int(count) + 1):
            new = value
            for n in reversed(names):
                new = tables[n][new]
            assert steps[i - 1] == f"{i}: {var} = {' '.join(names)} {value} = {new}", (item, i)
            assert len(tok(steps[i - 1] + ".")["input_ids"]) == 10, steps[i - 1]
            seen.append(value)
            value = new
        assert len(set(seen + [value])) == len(seen) + 1 <= max_value - 1  # no value twice, two or more never seen
        assert item["answer"] == str(value) and item["solution"].endswith(f"\\boxed{{{value}}}.")
        assert synthetic.lookup_tables(item["problem"]) == tables
        ids = tok(item["problem"])["input_ids"]
        # every key and value of the tables, the start and the step count: one digit token each
        assert sum(i in digits for i in ids) == 2 * max_value * len(tables) + 2
        prompt = tok.apply_chat_template(synthetic.to_messages(item, "solution")[:1], add_generation_prompt=True,
                                         return_dict=True)["input_ids"]
        ratios.append((len(tok(item["solution"])["input_ids"]) + 1) / len(prompt))
    if num_steps[0] >= 5:  # the synthetic-lookup task's chains: the reply (with its end token) outgrows the prompt
        assert min(ratios) > 1.2, min(ratios)
    with pytest.raises(ValueError, match="odd"):
        synthetic.make_split("test", 5, num_steps=(3, 4), max_value=6, form="lookup")  # p with p(p(y)) one cycle: n odd
    with pytest.raises(ValueError, match="at most max_value - 2"):  # a chain back at its start needs no look-up
        synthetic.make_split("test", 5, num_steps=(5, 7), max_value=5, form="lookup")


def test_first_mistake_says_where_a_digit_sum_reply_departs_from_its_worked_solution():
    """The report's mistake table rests on this: a right reply has no mistake; each kind of mistake is found at
    its step; later steps are judged on the reply's own chain, so one wrong sum is one mistake."""
    item = {"problem": "y = 7. 3 step y + 6 sum.", "answer": "7"}
    right = "1: y = 7 + 6 = 4. 2: y = 4 + 6 = 1. 3: y = 1 + 6 = 7. The answer is \\boxed{7}."
    assert synthetic.first_mistake(item, right) is None
    cases = {
        "1: y = 7 + 6 = 4. 2: y = 4 + 6 = 2. 3: y = 2 + 6 = 8. The answer is \\boxed{8}.": (2, "sum"),
        "1: y = 7 + 6 = 4. 2: y = 4 + 6 = 1. 3: y = 4 + 6 = 1. The answer is \\boxed{1}.": (3, "copy"),
        "1: y = 7 + 5 = 3. The answer is \\boxed{3}.": (1, "copy"),
        "1: b = 7 + 6 = 4. 2: b = 4 + 6 = 1. 3: b = 1 + 6 = 7. The answer is \\boxed{7}.": (1, "copy"),
        "1: y = 7 + 6 = 4. 2: y = 4 + 6 = 1. The answer is \\boxed{1}.": (3, "steps"),
        right.replace(" The", " 4: y = 7 + 6 = 4. The"): (4, "steps"),
        right.replace("\\boxed{7}", "\\boxed{1}"): (4, "answer"),
        "1: y = 7 + 6 = 4. 3: y = 4 + 6 = 1. The answer is \\boxed{1}.": (2, "format"),
        "1: y = 7 + 6 = 4. 2 y y y 3 3 3 3": (2, "format"),
        "": (1, "format"),
    }
    for reply, expected in cases.items():
        assert synthetic.first_mistake(item, reply) == expected, reply
    # every solution the generator writes reads back as right
    for row in synthetic.make_split("test", 90, seed=0, num_steps=(5, 7), form="digit-sum"):
        assert synthetic.first_mistake(row, row["solution"]) is None
    with pytest.raises(ValueError, match="not a digit-sum problem"):
        synthetic.first_mistake({"problem": "a = 7. b = a + 5. What is b?"}, "The answer is \\boxed{12}.")


def test_schemas_of_the_paper_datasets_become_chats():
    ace = {"category": "math", "source": "x", "input": "Q?", "output": "<think>r</think> A"}
    ot3 = {"difficulty": 5, "source": "y", "domain": "math",
           "conversations": [{"from": "human", "value": "Q?"}, {"from": "gpt", "value": "A"}]}
    want = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A"}]
    assert to_messages(ot3) == want
    assert to_messages(ace)[0] == want[0] and to_messages(ace)[1]["content"] == "<think>r</think> A"
    assert to_messages({"problem": "Q?", "solution": "A"}) == want
    assert to_messages({"text": "hello"}) is None


def test_loss_mask_covers_exactly_the_assistant_reply(tok):
    msgs = [{"role": "user", "content": "a = 3. What is a?"}, {"role": "assistant", "content": "\\boxed{3}"},
            {"role": "user", "content": "and b?"}, {"role": "assistant", "content": "\\boxed{4}"}]
    ids, mask = encode_chat(tok, msgs, 512)
    assert tok.decode(ids) == tok.apply_chat_template(msgs, tokenize=False)
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert trained == "\\boxed{3}<|im_end|>\\boxed{4}<|im_end|>"
    short = encode_chat(tok, msgs, 12)  # truncation inside the first prompt: nothing to learn
    assert short is None
    one, _ = encode_chat(tok, msgs[:2], 512)
    ids2, mask2 = encode_chat(tok, msgs[:2], len(one) - 2)  # keeps part of the reply
    assert ids2 == one[:-2] and any(mask2)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_mixture_weights_local_files_and_resume(tmp_path, tok):
    _write_jsonl(tmp_path / "a.jsonl", [{"input": f"A{i}?", "output": f"a{i}"} for i in range(30)])
    import pandas as pd

    pd.DataFrame({"conversations": [[{"from": "human", "value": f"B{i}?"}, {"from": "gpt", "value": f"b{i}"}] for i in range(30)]}) \
        .to_parquet(tmp_path / "b.parquet")
    specs = [{"source": "local", "path": str(tmp_path / "a.jsonl"), "weight": 0.5},
             {"source": "local", "path": str(tmp_path / "b.parquet"), "weight": 0.5},
             {"source": "synthetic", "n": 50, "weight": 0.0}]
    s = DataStream(specs, tok, 64, seed=0, shuffle_buffer=8)
    first = [tok.decode(s.next().input_ids) for _ in range(40)]  # crosses an epoch of one file
    a = sum("user\nA" in t for t in first)
    assert 10 <= a <= 30 and all("user\nA" in t or "user\nB" in t for t in first)
    state = s.state_dict()
    nxt = [s.next().input_ids for _ in range(10)]
    again = DataStream(specs, tok, 64, seed=0, shuffle_buffer=8)
    again.load_state_dict(json.loads(json.dumps(state)))
    assert [again.next().input_ids for _ in range(10)] == nxt


def test_same_seed_same_order_and_processes_split_one_stream(tok):
    specs = [{"source": "synthetic", "n": 40, "num_steps": 1, "weight": 1.0},
             {"source": "synthetic", "n": 40, "num_steps": 3, "weight": 3.0}]
    s = DataStream(specs, tok, 64, seed=0)
    first = [s.next().input_ids for _ in range(30)]
    assert first == [x.input_ids for x in (lambda d: [d.next() for _ in range(30)])(DataStream(specs, tok, 64, seed=0))]
    assert first != [x.input_ids for x in (lambda d: [d.next() for _ in range(30)])(DataStream(specs, tok, 64, seed=1))]
    r0 = DataStream(specs, tok, 64, seed=0, rank=0, world_size=2)
    r1 = DataStream(specs, tok, 64, seed=0, rank=1, world_size=2)
    assert [r0.next().input_ids, r1.next().input_ids, r0.next().input_ids, r1.next().input_ids] == first[:4]


def test_data_errors_are_user_errors(tmp_path, tok):
    _write_jsonl(tmp_path / "x.jsonl", [{"text": "no chat here"}])
    with pytest.raises(UserError, match="cannot make a chat from columns"):
        DataStream([{"source": "local", "path": str(tmp_path / "x.jsonl")}], tok, 64, seed=0).next()
    with pytest.raises(UserError, match="matches no files"):
        DataStream([{"source": "local", "path": str(tmp_path / "none*.jsonl")}], tok, 64, seed=0).next()
    with pytest.raises(UserError, match="Hugging Face Hub"):  # offline in tests
        DataStream([{"source": "hub", "path": "nvidia/AceReason-1.1-SFT"}], tok, 64, seed=0).next()


def test_collate_pads_right(tok):
    s = DataStream([{"source": "synthetic", "n": 20}], tok, 64, seed=0)
    exs = [s.next() for _ in range(3)]
    b = collate(exs, tok.pad_token_id)
    for r, e in enumerate(exs):
        n = len(e.input_ids)
        assert b["input_ids"][r, :n].tolist() == e.input_ids and b["attention_mask"][r].sum() == n
        assert not b["attention_mask"][r, n:].any() and not b["loss_mask"][r, n:].any()


def test_prompt_length_is_the_shortest_prompt_of_the_batch(tok):
    s = DataStream([{"source": "synthetic", "n": 20}], tok, 64, seed=0)
    exs = [s.next() for _ in range(3)]
    exs[1].loss_mask[:] = [False] * 2 + exs[1].loss_mask[:-2]  # row 1's prompt two tokens longer
    first = exs[0].loss_mask.index(True)
    assert prompt_length(collate(exs, tok.pad_token_id)["loss_mask"]) == first
    assert prompt_length(collate(exs[1:2], tok.pad_token_id)["loss_mask"]) == first + 2
    exs[2].loss_mask[:] = [False] * len(exs[2].loss_mask)  # a row with no reply: no prompt to take whole
    assert prompt_length(collate(exs, tok.pad_token_id)["loss_mask"]) == 0


def test_tiny_tokenizer_keeps_the_demo_task_short(tok):
    """The demo's training and decoding time grow with sequence length: the tiny tokenizer learned the
    task's chat form, so a rendered problem with its answer stays near 35 tokens, roles one token each."""
    lengths = [len(encode_chat(tok, synthetic.to_messages(x), 64)[0])
               for x in synthetic.make_split("test", 200, seed=0, num_steps=(1, 2))]
    assert max(lengths) <= 36, max(lengths)
    assert tok.tokenize("user") == ["user"] and tok.tokenize("assistant") == ["assistant"]


def _chats(n):
    return [{"messages": [{"role": "user", "content": "q" * (3 + 7 * i)}, {"role": "assistant", "content": "a b c " * (1 + i)}]}
            for i in range(n)]


def test_overlong_examples_are_kept_truncated_or_dropped_as_the_recipe_says(tmp_path, tok):
    _write_jsonl(tmp_path / "c.jsonl", _chats(12))
    spec = [{"source": "local", "path": str(tmp_path / "c.jsonl")}]
    whole = [len(e.input_ids) for e in (lambda d: [d.next() for _ in range(12)])(DataStream(spec, tok, 10**6, seed=0, shuffle_buffer=0))]
    limit = sorted(whole)[6]
    longer = sum(n > limit for n in whole)
    assert longer >= 3
    kept = DataStream(spec, tok, limit, seed=0, shuffle_buffer=0, overlong="keep")
    assert [len(kept.next().input_ids) for _ in range(12)] == whole  # the default: whole examples
    cut = DataStream(spec, tok, limit, seed=0, shuffle_buffer=0, overlong="truncate")
    assert max(len(cut.next().input_ids) for _ in range(12)) == limit and cut.truncated == longer
    dropped = DataStream(spec, tok, limit, seed=0, shuffle_buffer=0, overlong="drop")
    # one past the epoch: every long example was met and dropped
    assert all(len(dropped.next().input_ids) <= limit for _ in range(12 - longer + 1)) and dropped.dropped == longer
    assert dropped.state_dict()["dropped"] == longer


def test_bucketing_groups_similar_lengths_and_pads_less(tok):
    from melt_eval.training.data import bucket

    s = DataStream([{"source": "synthetic", "n": 200, "num_steps": [1, 3]}], tok, 10**6, seed=0)
    exs = [s.next() for _ in range(32)]
    groups = bucket(exs, 4, tok.pad_token_id)
    assert len(groups) == 8 and sum(int(g["attention_mask"].sum()) for g in groups) == sum(len(e.input_ids) for e in exs)
    slots = sum(g["attention_mask"].numel() for g in groups)
    unsorted = sum(collate(exs[i : i + 4], tok.pad_token_id)["attention_mask"].numel() for i in range(0, 32, 4))
    assert slots < unsorted
    widths = [g["input_ids"].shape[1] for g in groups]
    assert widths == sorted(widths, reverse=True)


def test_the_paper_recipes_train_the_papers_10k_sequences():
    """A longer reasoning trace is truncated (and counted), never kept whole at 3x the step's memory."""
    from melt_eval.training import load_recipe

    for name in ("paper-phase1", "paper-phase2"):
        recipe = load_recipe(name, overrides={"data": [{"source": "synthetic"}]})
        assert (recipe.seq_len, recipe.overlong) == (10_000, "truncate"), name

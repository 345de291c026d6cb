"""Data: GSM8K preprocessing, RL prompt dataset, left-pad collate, resumable loader,
synthetic arithmetic task and preference pairs."""

import json
import logging
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO
sys.path.insert(0, str(REPO))

torch = pytest.importorskip("torch")
pytest.importorskip("datasets")
pytest.importorskip("transformers")

from rlhf.data.gsm8k import (  # noqa: E402
    INSTRUCTION,
    extract_gsm8k_ground_truth,
    gsm8k_row,
    preprocess_gsm8k,
)
from rlhf.data.collate import collate_left_pad, pad_sequences  # noqa: E402
from rlhf.data.loader import StatefulPromptLoader  # noqa: E402
from rlhf.data.preference import (  # noqa: E402
    encode_preference_pair,
    encode_preference_pairs,
    load_preference_dataset,
    write_preference_parquet,
)
from rlhf.data.rl_dataset import RLDataset, RLHFDataset, load_rl_dataset  # noqa: E402
from rlhf.quickstart.arithmetic import (  # noqa: E402
    make_arithmetic_dataset,
    make_synthetic_preference_dataset,
    write_arithmetic_parquet,
)
from rlhf.rewards import compute_scores  # noqa: E402
from rlhf.rewards.gsm8k import compute_score  # noqa: E402
from tests.support.tiny_tokenizer import make_tiny_tokenizer  # noqa: E402

GSM8K_DIR = REPO / ".." / "shared" / "data" / "gsm8k"
needs_gsm8k = pytest.mark.skipif(
    not (GSM8K_DIR / "train.jsonl").is_file(), reason="shared GSM8K copy not present at ../shared/data/gsm8k"
)


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _head_jsonl(src, dst, n):
    with open(src) as f:
        lines = [next(f) for _ in range(n)]
    dst.write_text("".join(lines))
    return [json.loads(line) for line in lines]


# --------------------------------------------------------------------------- gsm8k


def test_extract_gsm8k_ground_truth():
    assert extract_gsm8k_ground_truth("a\nb\n#### 72") == "72"
    assert extract_gsm8k_ground_truth("#### 1,000") == "1000"
    assert extract_gsm8k_ground_truth("#### -3") == "-3"
    with pytest.raises(ValueError, match="no '#### <number>'"):
        extract_gsm8k_ground_truth("just text")
    row = gsm8k_row("What is 1+1?", "1+1=2\n#### 2", "test", 5)
    assert row == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "What is 1+1? " + INSTRUCTION}],
        "ground_truth": "2",
        "ability": "math",
        "extra_info": {"split": "test", "index": 5, "question": "What is 1+1?", "answer": "1+1=2\n#### 2"},
    }
    assert INSTRUCTION == 'Let\'s think step by step and output the final answer after "####".'
    assert gsm8k_row("q", "#### 2", "train", 0, flat_prompt=True)["prompt"] == "q " + INSTRUCTION


@needs_gsm8k
def test_preprocess_first_50_real_gsm8k(tmp_path):
    import pyarrow.parquet as pq

    raw_dir = tmp_path / "raw"
    raw_dir.mkdir()
    train_raw = _head_jsonl(GSM8K_DIR / "train.jsonl", raw_dir / "train.jsonl", 50)
    _head_jsonl(GSM8K_DIR / "test.jsonl", raw_dir / "test.jsonl", 10)
    paths = preprocess_gsm8k(tmp_path / "out", local_path=raw_dir)
    rows = pq.read_table(paths["train"]).to_pylist()
    assert len(rows) == 50 and len(pq.read_table(paths["test"])) == 10
    assert set(rows[0]) >= {"data_source", "prompt", "ground_truth", "ability", "extra_info"}
    for i, (row, raw) in enumerate(zip(rows, train_raw)):
        want = raw["answer"].split("####")[-1].strip().replace(",", "")
        assert row["ground_truth"] == want
        assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
        assert row["prompt"] == [{"role": "user", "content": raw["question"] + " " + INSTRUCTION}]
        assert row["extra_info"]["split"] == "train" and row["extra_info"]["index"] == i
        # the reference answer itself scores 1 under the strict reward
        assert compute_score(raw["answer"], row["ground_truth"]) == 1.0
    assert rows[0]["ground_truth"] == "72"  # Natalia's clips


@needs_gsm8k
def test_preprocess_script_cli(tmp_path):
    import pyarrow.parquet as pq

    sys.path.insert(0, str(REPO / "scripts"))
    import preprocess_gsm8k as script

    raw_dir = tmp_path / "raw"
    raw_dir.mkdir()
    for split in ("train", "test"):
        _head_jsonl(GSM8K_DIR / f"{split}.jsonl", raw_dir / f"{split}.jsonl", 5)
    assert script.main(["--out", str(tmp_path / "o"), "--local-path", str(raw_dir), "--flat-prompt"]) == 0
    rows = pq.read_table(tmp_path / "o" / "test.parquet").to_pylist()
    assert len(rows) == 5 and isinstance(rows[0]["prompt"], str) and rows[0]["prompt"].endswith(INSTRUCTION)


def test_preprocess_missing_local_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="train.jsonl"):
        preprocess_gsm8k(tmp_path / "o", local_path=tmp_path)


# --------------------------------------------------------------------------- RL dataset


@needs_gsm8k
def test_rl_dataset_reads_raw_gsm8k_jsonl_via_relative_path(tok):
    # the exact string a config would use: data.train_files=../shared/data/gsm8k/train.jsonl
    ds = load_rl_dataset("../shared/data/gsm8k/test.jsonl", tok, max_prompt_length=4096, max_samples=20)
    assert len(ds) == 20
    it = ds[0]
    raw = json.loads(open(GSM8K_DIR / "test.jsonl").readline())
    assert it["raw_prompt"] == [{"role": "user", "content": raw["question"] + " " + INSTRUCTION}]
    assert it["ground_truth"] == raw["answer"].split("#### ")[-1].replace(",", "")
    assert it["data_source"] == "openai/gsm8k" and it["index"] == 0
    text = tok.apply_chat_template(it["raw_prompt"], tokenize=False, add_generation_prompt=True)
    assert it["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(it["input_ids"]).endswith("<|im_start|>assistant\n")


def test_rl_dataset_parquet_multi_file_and_filter_count(tmp_path, tok, caplog):
    paths = write_arithmetic_parquet(tmp_path / "arith", n_train=30, n_test=10, seed=3)
    # one extra jsonl file with a flat-string prompt, a long prompt, and a verl-style row
    extra = _write_jsonl(tmp_path / "extra.jsonl", [
        {"prompt": "2+2=", "ground_truth": "4", "data_source": "synthetic/arithmetic"},
        {"prompt": [{"role": "user", "content": "word " * 300}], "ground_truth": "1", "data_source": "x"},
        {"prompt": [{"role": "user", "content": "1+1="}], "reward_model": {"ground_truth": "2"}, "data_source": "y"},
    ])
    lengths = []
    for r in make_arithmetic_dataset(30, seed=3) + make_arithmetic_dataset(10, seed=4):
        text = tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
        lengths.append(len(tok(text, add_special_tokens=False)["input_ids"]))
    max_len = sorted(lengths)[len(lengths) // 2]  # about half of the arithmetic prompts are too long
    expected_filtered = sum(length > max_len for length in lengths) + 1  # + the 300-word prompt
    with caplog.at_level(logging.INFO, logger="rlhf.data.rl_dataset"):
        ds = RLDataset([paths["train"], paths["test"], extra], tok, max_prompt_length=max_len)
    assert ds.num_filtered == expected_filtered
    assert ds.num_rows_read == 43
    assert len(ds) == 43 - expected_filtered
    assert any(f"filtered {expected_filtered} prompts longer than max_prompt_length={max_len}" in m
               for m in caplog.messages)
    assert all(len(it["input_ids"]) <= max_len for it in ds)
    by_index = {it["index"]: it for it in ds}
    assert by_index[40]["raw_prompt"] == "2+2=" and by_index[40]["ground_truth"] == "4"
    assert by_index[42]["ground_truth"] == "2"  # verl reward_model.ground_truth
    assert 41 not in by_index  # the long one
    # indices are global row positions, unique and increasing
    idx = [it["index"] for it in ds]
    assert idx == sorted(set(idx))


def test_rl_dataset_options(tmp_path, tok):
    f = _write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "3+4=", "ground_truth": "7"},
        {"prompt": "word " * 50, "ground_truth": "1"},
        {"prompt": "5+1=", "ground_truth": "6"},
    ])
    with pytest.raises(KeyError, match="default_data_source"):
        RLDataset(f, tok, 32)
    # plain text (no chat template): BOS-free tiny tokenizer -> ids == tok(prompt)
    plain = make_tiny_tokenizer(chat_template=False)
    ds = RLDataset(f, plain, 32, default_data_source="synthetic/arithmetic")
    assert [it["input_ids"] for it in ds] == [plain("3+4=")["input_ids"], plain("5+1=")["input_ids"]]
    assert ds.num_filtered == 1
    # max_samples counts kept prompts
    assert len(RLDataset(f, tok, 32, default_data_source="s", max_samples=1)) == 1
    # truncate_left keeps the tail (generation prompt)
    tr = RLDataset(f, tok, 32, default_data_source="s", overlong="truncate_left")
    assert len(tr) == 3 and tr.num_truncated == 1 and len(tr[1]["input_ids"]) == 32
    assert tok.decode(tr[1]["input_ids"]).endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="max_prompt_length=32"):
        RLDataset(f, tok, 32, default_data_source="s", overlong="error")
    with pytest.raises(ValueError, match="No prompts left"):
        RLDataset(f, tok, 2, default_data_source="s")
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        RLDataset(tmp_path / "nope.parquet", tok, 32)
    with pytest.raises(KeyError, match="question"):
        RLDataset(_write_jsonl(tmp_path / "bad.jsonl", [{"text": "x"}]), tok, 32, default_data_source="s")
    with pytest.raises(ValueError, match="no chat_template"):
        RLDataset(f, plain, 32, default_data_source="s", use_chat_template=True)


# --------------------------------------------------------------------------- collate


def test_collate_left_pad_exact():
    items = [
        {"input_ids": [5, 6, 7], "ground_truth": "1", "index": 0},
        {"input_ids": [8], "ground_truth": "2", "index": 1},
        {"input_ids": torch.tensor([9, 10]), "ground_truth": "3", "index": 2},
    ]
    b = collate_left_pad(items, pad_token_id=0)
    assert torch.equal(b["input_ids"], torch.tensor([[5, 6, 7], [0, 0, 8], [0, 9, 10]]))
    assert torch.equal(b["attention_mask"], torch.tensor([[1, 1, 1], [0, 0, 1], [0, 1, 1]]))
    assert torch.equal(b["position_ids"], torch.tensor([[0, 1, 2], [0, 0, 0], [0, 0, 1]]))
    assert b["input_ids"].dtype == torch.long and b["attention_mask"].dtype == torch.long
    assert b["ground_truth"] == ["1", "2", "3"] and b["index"] == [0, 1, 2]

    b5 = collate_left_pad(items[:2], pad_token_id=99, pad_to=5)
    assert torch.equal(b5["input_ids"], torch.tensor([[99, 99, 5, 6, 7], [99, 99, 99, 99, 8]]))
    assert torch.equal(b5["position_ids"], torch.tensor([[0, 0, 0, 1, 2], [0, 0, 0, 0, 0]]))
    with pytest.raises(ValueError, match="pad_to=2"):
        collate_left_pad(items, 0, pad_to=2)
    with pytest.raises(ValueError, match="empty"):
        collate_left_pad([], 0)


def test_pad_sequences_sides_length_and_dtype():
    seqs = [[1, 2, 3], [], [4]]
    v, m = pad_sequences(seqs, 0, side="left")
    assert torch.equal(v, torch.tensor([[1, 2, 3], [0, 0, 0], [0, 0, 4]]))
    assert torch.equal(m, torch.tensor([[1, 1, 1], [0, 0, 0], [0, 0, 1]]))
    v, m = pad_sequences(seqs, -100, side="right", length=4)
    assert torch.equal(v, torch.tensor([[1, 2, 3, -100], [-100] * 4, [4, -100, -100, -100]]))
    assert torch.equal(m, torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]]))
    v, _ = pad_sequences([[0.5, -1.25]], 0.0, side="right", length=3, dtype=torch.float32)
    assert v.dtype == torch.float32 and v.tolist() == [[0.5, -1.25, 0.0]]
    with pytest.raises(ValueError, match="length=2"):
        pad_sequences(seqs, 0, length=2)
    with pytest.raises(ValueError, match="side='middle'"):
        pad_sequences(seqs, 0, side="middle")
    assert RLDataset is RLHFDataset  # the old name still works


# --------------------------------------------------------------------------- loader


class _Range:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def _take(loader, k):
    return [loader.next_batch() for _ in range(k)]


@pytest.mark.parametrize("drop_last", [True, False])
def test_loader_epochs_are_seeded_permutations(drop_last):
    loader = StatefulPromptLoader(_Range(10), batch_size=3, shuffle=True, seed=7, drop_last=drop_last)
    assert len(loader) == (3 if drop_last else 4)
    e0 = [x for b in loader for x in b]
    assert loader.state_dict() == {"epoch": 1, "step_in_epoch": 0}
    e1 = [x for b in loader for x in b]
    assert len(e0) == (9 if drop_last else 10) and len(set(e0)) == len(e0)
    assert e0 != e1  # reshuffled each epoch
    again = StatefulPromptLoader(_Range(10), batch_size=3, shuffle=True, seed=7, drop_last=drop_last)
    assert [x for b in again for x in b] == e0  # deterministic
    assert [x for b in StatefulPromptLoader(_Range(10), 3, shuffle=False, drop_last=drop_last) for x in b] == \
        list(range(len(e0)))


@pytest.mark.parametrize("consumed", [0, 1, 2, 3, 4, 6, 7])
def test_loader_resume_equality(consumed):
    """Resuming from state_dict after `consumed` batches (3 per epoch, so 3 and 6 are epoch
    boundaries) yields exactly what the uninterrupted loader yields next."""
    ref = StatefulPromptLoader(_Range(10), batch_size=3, shuffle=True, seed=11)
    expected = _take(ref, consumed + 5)

    a = StatefulPromptLoader(_Range(10), batch_size=3, shuffle=True, seed=11)
    got = _take(a, consumed)
    state = a.state_dict()
    assert state["step_in_epoch"] < 3 and state["epoch"] == consumed // 3
    b = StatefulPromptLoader(_Range(10), batch_size=3, shuffle=True, seed=11)
    b.load_state_dict(dict(state))
    assert got + _take(b, 5) == expected


def test_loader_resume_mid_epoch_with_for_loop():
    ref = StatefulPromptLoader(_Range(12), batch_size=4, seed=1)
    full = [list(b) for _ in range(2) for b in ref]

    a = StatefulPromptLoader(_Range(12), batch_size=4, seed=1)
    seen = []
    for b in a:
        seen.append(list(b))
        if len(seen) == 2:
            break
    state = a.state_dict()
    assert state == {"epoch": 0, "step_in_epoch": 2}
    r = StatefulPromptLoader(_Range(12), batch_size=4, seed=1)
    r.load_state_dict(state)
    seen += [list(b) for b in r]  # rest of epoch 0
    seen += [list(b) for b in r]  # epoch 1
    assert seen == full
    # an epoch-end state (step == len) loads as the next epoch
    r2 = StatefulPromptLoader(_Range(12), batch_size=4, seed=1)
    r2.load_state_dict({"epoch": 0, "step_in_epoch": 3})
    assert r2.state_dict() == {"epoch": 1, "step_in_epoch": 0}
    assert [list(b) for b in r2] == full[3:]
    with pytest.raises(ValueError, match="invalid state"):
        r2.load_state_dict({"epoch": 0, "step_in_epoch": 4})
    with pytest.raises(KeyError, match="step_in_epoch"):
        r2.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="batch_size=20"):
        StatefulPromptLoader(_Range(12), batch_size=20)


def test_loader_with_rl_dataset_collates(tmp_path, tok):
    paths = write_arithmetic_parquet(tmp_path, n_train=16, n_test=4, seed=0, style="short")
    ds = RLDataset(paths["train"], tok, max_prompt_length=64)
    loader = StatefulPromptLoader(ds, batch_size=4, seed=0)
    batch = next(iter(loader))
    assert batch["input_ids"].shape[0] == 4 and batch["attention_mask"].shape == batch["input_ids"].shape
    assert len(batch["ground_truth"]) == 4 and batch["data_source"] == ["synthetic/arithmetic"] * 4
    assert (batch["input_ids"][:, -1] == batch["input_ids"][0, -1]).all()  # left padded: all end on the prompt tail


# --------------------------------------------------------------------------- synthetic


def test_arithmetic_dataset_schema_and_answers():
    rows = make_arithmetic_dataset(50, seed=0, max_operand=9, ops=("+", "-", "*"))
    assert rows == make_arithmetic_dataset(50, seed=0, max_operand=9, ops=("+", "-", "*"))  # deterministic
    assert rows != make_arithmetic_dataset(50, seed=1, max_operand=9, ops=("+", "-", "*"))
    for r in rows:
        assert set(r) == {"data_source", "prompt", "ground_truth", "ability", "extra_info", "solution"}
        assert r["data_source"] == "synthetic/arithmetic" and r["ability"] == "math"
        e = r["extra_info"]
        a, b, op = e["a"], e["b"], e["op"]
        assert 1 <= a <= 9 and 1 <= b <= 9
        want = {"+": a + b, "-": a - b, "*": a * b}[op]
        assert want >= 0 and r["ground_truth"] == str(want)
        assert r["solution"].endswith(f"#### {want}")
        assert compute_score(r["solution"], r["ground_truth"]) == 1.0
    scores, nfb = compute_scores([r["data_source"] for r in rows], [r["solution"] for r in rows],
                                 [r["ground_truth"] for r in rows])
    assert scores == [1.0] * 50 and nfb == 0
    r0 = make_arithmetic_dataset(1, seed=0)[0]
    assert " and buys " in r0["prompt"][0]["content"] and r0["prompt"][0]["content"].endswith(INSTRUCTION)
    short = make_arithmetic_dataset(3, seed=0, style="short")
    for r in short:
        e = r["extra_info"]
        assert r["prompt"] == [{"role": "user", "content": f"{e['a']}+{e['b']}="}]
        assert r["solution"] == f"{e['a']}+{e['b']}={e['a'] + e['b']}\n#### {e['a'] + e['b']}"
    with pytest.raises(ValueError, match="'/'"):
        make_arithmetic_dataset(2, ops=("/",))
    with pytest.raises(ValueError, match="style='long'"):
        make_arithmetic_dataset(2, style="long")


# --------------------------------------------------------------------------- preference


def test_preference_synthetic_and_load(tmp_path, tok):
    pairs = make_synthetic_preference_dataset(20, seed=0, ops=("+", "-"))
    for p in pairs:
        assert p["chosen"] != p["rejected"]
        assert compute_score(p["chosen"], p["ground_truth"]) == 1.0
        assert compute_score(p["rejected"], p["ground_truth"]) == 0.0
    path = write_preference_parquet(pairs, tmp_path / "pref" / "train.parquet")
    loaded = load_preference_dataset(path)
    assert [(r["prompt"], r["chosen"], r["rejected"]) for r in loaded] == \
        [(p["prompt"], p["chosen"], p["rejected"]) for p in pairs]
    jl = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi", "chosen": "a", "rejected": "b"}] * 3)
    assert len(load_preference_dataset([jl, path], max_samples=5)) == 5
    with pytest.raises(KeyError, match="rejected"):
        load_preference_dataset(_write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "chosen": "a"}]))
    enc = encode_preference_pair(tok, pairs[0]["prompt"], pairs[0]["chosen"], pairs[0]["rejected"], max_length=256)
    assert enc["chosen_ids"][-1] == tok.eos_token_id and enc["rejected_ids"][-1] == tok.eos_token_id
    assert tok.decode(enc["prompt_ids"]).endswith("<|im_start|>assistant\n")
    assert tok.decode(enc["chosen_ids"][:-1]) == pairs[0]["chosen"]
    # several pairs: responses cut to max_response_length, pairs with long prompts dropped
    many = encode_preference_pairs(tok, pairs[:3], max_prompt_length=len(enc["prompt_ids"]), max_response_length=4)
    assert [e["chosen_ids"] for e in many[:1]] == [enc["chosen_ids"][:4]] and all(
        len(e["rejected_ids"]) <= 4 and len(e["prompt_ids"]) <= len(enc["prompt_ids"]) for e in many)
    with pytest.raises(ValueError, match="max_prompt_length=1"):
        encode_preference_pairs(tok, pairs[:3], max_prompt_length=1, max_response_length=4)

"""data=passkey and its retrieval score (issue 13): the generator, the teacher-forced exact match under CP, the
agreement with greedy generate(), the refusals, and scripts/eval_retrieval.py end to end."""
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dist_harness import run_ranks
from test_engine import BASE, _run, assert_same_trajectory
from tiny_models import tiny_model

from configs import ConfigError, compose_config, validate
from engine.data import DataError, build_dataset, count_target_tokens, load_tokenizer
from engine.data.passkey import PasskeyTask, grid_sample

ROOT = Path(__file__).resolve().parent.parent
PASSKEY = ["data=passkey", "data.seq_len=160", "data.num_samples=64"]
ENGINE = [o for o in BASE if not o.startswith("data")]  # the engine tests' settings, on passkey data


def train(tmp_path, name, world, extra):
    out = tmp_path / name
    run_ranks(_run, world, ENGINE + PASSKEY + [f"run.out_dir={out}"] + extra)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _cfg(extra=()):
    return compose_config(["model=tiny", "device=cpu", "parallelism.cp=1"] + PASSKEY + list(extra))


def _dataset(extra=()):
    cfg = _cfg(extra)
    validate(cfg, 1)
    return build_dataset(cfg.data, seed=cfg.run.seed, vocab_size=cfg.model.arch["vocab_size"])


def _digest(item) -> str:
    return hashlib.sha1(item["input_ids"].numpy().tobytes() + item["labels"].numpy().tobytes()).hexdigest()


# --- the generator ---------------------------------------------------------------------------------------------


def _digests_on_rank(rank, world, out_dir, extra):
    ds, _, _ = _dataset(extra)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps([_digest(ds[i]) for i in range(16)]))


def test_samples_depend_on_seed_and_index_only_never_on_the_layout(tmp_path):
    ds, _, _ = _dataset()
    here = [_digest(ds[i]) for i in range(16)]
    assert here == [_digest(_dataset()[0][i]) for i in range(16)]  # rebuilt: the same samples
    assert len(set(here)) == 16
    other_seed = build_dataset(_cfg().data, seed=1, vocab_size=512)[0]
    assert all(_digest(other_seed[i]) != here[i] for i in range(16))
    # forked ranks (RANK, WORLD_SIZE set, a process group up) build the same samples as this process
    run_ranks(_digests_on_rank, 2, str(tmp_path), [])
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == here
    # and the training steps built from them are the same on every layout (loss, tokens, grad norm)
    steps = ["data.seq_len=100", "data.passkey.lengths=[90,100]", "trainer.max_steps=2"]
    ref = train(tmp_path, "w1", 1, steps + ["parallelism.cp=1"])
    assert all(r["tokens"] > 0 for r in ref)
    assert_same_trajectory(train(tmp_path, "w4_cp2_dp2", 4, steps + ["parallelism.cp=2"]), ref, "passkey cp2 dp2")


def test_lengths_are_exact_and_drawn_from_the_list():
    ds, _, _ = _dataset(["data.passkey.lengths=[100,128,160]"])
    lengths = {ds[i]["input_ids"].numel() for i in range(40)}
    assert lengths == {100, 128, 160}


@pytest.mark.parametrize("extra", [[], ["data.passkey.filler=repeat", "data.passkey.key=letters"]])
def test_the_key_lands_at_the_requested_depth_within_one_filler_sentence(extra):
    ds, _, tok = _dataset(extra + ["data.seq_len=600"])
    task = ds.task
    longest = max(len(s) for s in task.sentences)
    for depth in (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0):
        for j in range(3):
            s = grid_sample(task, 0, 600, depth, j)
            assert len(s.input_ids) == 600
            start = s.needle_starts[0]  # with one needle, the filler tokens before it
            assert abs(start - depth * s.filler_len) <= longest / 2 + 1, (depth, start, s.filler_len)
            needle = tok.decode(s.input_ids[start:start + 30])
            assert needle.startswith(f" The pass key is #{s.keys[0]}."), needle
    # depths drawn for training stay inside data.passkey.depth_min..depth_max
    ds, _, _ = _dataset(extra + ["data.seq_len=600", "data.passkey.depth_min=0.6", "data.passkey.depth_max=0.8"])
    for i in range(20):
        s = ds.sample(i)
        assert 0.6 * s.filler_len - longest / 2 - 1 <= s.needle_starts[0] <= 0.8 * s.filler_len + longest / 2 + 1


def test_the_answer_is_the_only_loss():
    ds, _, tok = _dataset()
    for i in range(8):
        s, item = ds.sample(i), ds[i]
        labelled = (item["labels"] != -100).nonzero().flatten().tolist()
        assert labelled == list(range(s.answer_start, 160)), i  # the last tokens, nothing else
        assert torch.equal(item["labels"][labelled], item["input_ids"][labelled])
        assert tok.decode(item["input_ids"][labelled]) == s.keys[0]
        assert tok.decode(item["input_ids"][:s.answer_start]).endswith("What is the pass key? The pass key is #")
        assert count_target_tokens(item["labels"]) == len(labelled)


def test_distractors_and_several_needles_ask_for_the_named_keys_in_order():
    ds, _, tok = _dataset(["data.seq_len=400", "data.passkey.num_needles=2", "data.passkey.num_distractors=3"])
    for i in range(6):
        s, item = ds.sample(i), ds[i]
        text = tok.decode(item["input_ids"])
        assert len(s.needle_starts) == 5 and len(s.keys) == 2
        question = text[text.rindex("What are the "):]
        name = question.split()[3]
        assert question.startswith(f"What are the {name} pass keys? The {name} pass keys are #")
        found = [seg.split(".")[0] for seg in text.split(f"The {name} pass key is #")[1:]]
        assert found == s.keys  # the asked name's keys, in order of appearance
        assert tok.decode(item["input_ids"][s.answer_start:]) == ", #".join(s.keys)
        assert text.count(" pass key is #") == 5  # three distractors under other names


@pytest.mark.parametrize("override, field", [
    (["data.passkey.lengths=[100,200]"], "data.passkey.lengths"),  # above data.seq_len=160
    (["data.passkey.eval_lengths=[320]"], "data.passkey.eval_lengths"),
    (["data.passkey.eval_depths=[]"], "data.passkey.eval_depths"),
    (["data.passkey.depth_min=0.8", "data.passkey.depth_max=0.2"], "data.passkey.depth_min"),
    (["data.passkey.key=emoji"], "data.passkey.key"),
])
def test_bad_passkey_configs_are_refused_before_the_build(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate(_cfg(override), 1)


def test_a_key_longer_than_the_context_is_refused_with_the_fix():
    with pytest.raises(DataError, match=r"raise data\.passkey\.lengths or lower data\.passkey\.key_length"):
        _dataset(["data.passkey.key_length=200"])


# --- the score under CP ----------------------------------------------------------------------------------------

KEY80 = SimpleNamespace(lengths=[], depth_min=0.0, depth_max=1.0, key="digits", key_length=80, num_needles=1,
                        num_distractors=0, filler="corpus")


def _reference_argmax(hf, ids):
    """The unsplit model's argmax after every position (what position i predicts for token i + 1)."""
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0].argmax(-1).tolist()


class RiggedTask:
    """Passkey samples whose answer labels are the unsplit model's own predictions (right) or those with one
    token changed (wrong), decided by the key's last digit: the expected verdict of every sample is known
    without the code under test. Labels are not inputs, so the forward stays the real sample's."""

    def __init__(self, task, hf):
        self.task, self.hf = task, hf

    def make(self, rng, length, depth=None):
        s = self.task.make(rng, length, depth)
        pred = _reference_argmax(self.hf, s.input_ids)
        answer = pred[s.answer_start - 1:length - 1]
        if not self.right(s):
            k = int(s.keys[0][0]) % len(answer)  # which answer token is made wrong varies with the sample
            answer[k] = (answer[k] + 1) % 512
        s.labels = s.labels[:s.answer_start] + answer
        return s

    @staticmethod
    def right(s) -> bool:
        return int(s.keys[0][-1]) % 2 == 0


# answers of 80 tokens: at cp=4 a chunk (75, 76 tokens) is shorter, so every answer straddles two ranks; 303 is not
# a multiple of cp
LENGTHS, DEPTHS, PER_CELL = [300, 303], [0.0, 0.5, 1.0], 3


def _score_on_rank(rank, world, cp, out_dir):
    from ds_ulysses_ext import CPCausalLM, enable_context_parallel, init_topology
    from engine.data import DEMO_TOKENIZER
    from engine.run.retrieval import score_retrieval
    topo = init_topology(cp)
    hf = tiny_model("llama", vocab_size=512).eval()
    unsplit = tiny_model("llama", vocab_size=512).eval()  # the same seed: the same weights, without CP
    rigged = RiggedTask(PasskeyTask(KEY80, load_tokenizer(DEMO_TOKENIZER)), unsplit)
    expected = [sum(RiggedTask.right(grid_sample(rigged.task, 0, L, d, j)) for j in range(PER_CELL)) / PER_CELL
                for L in LENGTHS for d in DEPTHS]
    # token accuracy: a wrong sample has exactly one of its L - answer_start answer tokens changed
    samples = [[grid_sample(rigged.task, 0, L, d, j) for j in range(PER_CELL)] for L in LENGTHS for d in DEPTHS]
    expected_tokens = [1 - sum(not RiggedTask.right(x) for x in cell) / sum(len(x.input_ids) - x.answer_start
                                                                            for x in cell) for cell in samples]
    lm = CPCausalLM(enable_context_parallel(hf, topo))
    got = score_retrieval(lm, rigged, 0, LENGTHS, DEPTHS, PER_CELL, topo, world // cp, 2, 0, torch.device("cpu"))
    if rank == 0:
        (Path(out_dir) / f"w{world}_cp{cp}.json").write_text(json.dumps({"got": got, "expected": expected,
                                                                          "expected_tokens": expected_tokens}))


def test_the_score_is_the_same_at_cp_1_2_and_4_and_right_sample_by_sample(tmp_path):
    results = []
    for world, cp in ((1, 1), (2, 2), (4, 4), (4, 2)):
        run_ranks(_score_on_rank, world, cp, str(tmp_path))
        results.append(json.loads((tmp_path / f"w{world}_cp{cp}.json").read_text()))
    expected = results[0]["expected"]
    assert 0 < sum(expected) < len(expected)  # some cells right, some wrong, some in between
    for r in results:
        assert [c["accuracy"] for c in r["got"]["cells"]] == expected
        assert [(c["length"], c["depth"]) for c in r["got"]["cells"]] == [(L, d) for L in LENGTHS for d in DEPTHS]
        assert r["got"]["mean_accuracy"] == pytest.approx(sum(expected) / len(expected), abs=1e-12)
        assert [c["token_accuracy"] for c in r["got"]["cells"]] == pytest.approx(r["expected_tokens"], abs=1e-12)
    assert min(results[0]["expected_tokens"]) < 1


def test_teacher_forced_exact_match_agrees_with_greedy_generate():
    from ds_ulysses_ext import CPCausalLM, shard_batch
    from engine.data import DEMO_TOKENIZER
    from engine.run.retrieval import answer_hits
    from ds_ulysses_ext import init_topology
    one = init_topology(1)  # the single-process topology (no process group)
    hf = tiny_model("llama", vocab_size=512).eval()
    lm = CPCausalLM(hf)
    task = PasskeyTask(SimpleNamespace(**{**vars(KEY80), "key_length": 3}), load_tokenizer(DEMO_TOKENIZER))
    agreed = {True: 0, False: 0}
    for j in range(4):
        s = grid_sample(task, 0, 96, 0.5, j)
        prompt = s.input_ids[:s.answer_start]
        n = len(s.input_ids) - s.answer_start
        greedy = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)[0, len(prompt):].tolist()
        changed = [greedy[:k] + [(greedy[k] + 1) % 512] + greedy[k + 1:] for k in (0, n // 2, n - 1)]
        for answer in [s.input_ids[s.answer_start:], greedy] + changed:
            ids = prompt + answer
            labels = [-100] * len(prompt) + answer
            shard = shard_batch({"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels])}, one)
            hits, counts = answer_hits(lm, shard, one)
            teacher_forced = bool(hits[0] == counts[0] == n)
            assert teacher_forced == (greedy == answer), (j, answer, greedy)
            agreed[teacher_forced] += 1
    assert agreed[True] == 4 and agreed[False] >= 12  # both verdicts were exercised


# --- scripts/eval_retrieval.py -----------------------------------------------------------------------------------


def _eval(args, tmp_path, world=2):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
           str(ROOT / "scripts" / "eval_retrieval.py")] + args
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_eval_script_scores_a_run_at_world_2_with_cp_2(tmp_path):
    # a 2-step run of data=passkey (a model that has not learned the task: it must score near zero)
    rows = train(tmp_path, "run", 2, ["parallelism.cp=2", "trainer.max_steps=2", "trainer.export_hf=true",
                                              "data.eval_samples=2", "trainer.eval_every=2",
                                              "data.passkey.eval_depths=[0.0,1.0]",
                                              "data.passkey.eval_samples_per_cell=2"])
    assert rows[-1]["retrieval_acc"] == 0.0
    assert json.loads((tmp_path / "run" / "retrieval.json").read_text())["step"] == 2
    out = tmp_path / "scored"
    proc = _eval([str(tmp_path / "run"), "parallelism.cp=2", "device=cpu", "lengths=[96,160]",
                  "depths=[0.0,0.5,1.0]", "samples_per_cell=2", f"out_dir={out}"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "retrieval.json").read_text())
    assert [(c["length"], c["depth"]) for c in result["cells"]] == [(L, d) for L in (96, 160) for d in (0.0, 0.5, 1.0)]
    assert all(c["accuracy"] == 0.0 for c in result["cells"]) and result["mean_accuracy"] == 0.0
    assert (out / "retrieval.png").stat().st_size > 1000
    assert "mean_accuracy: 0.0000" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["lengths=[8192]"], r"above the model's max_position_embeddings=4096"),
    (["depths=[]"], r"depths=\[\] is empty"),
    (["data.passkey.key_length=100", "lengths=[64]"], r"lower data\.passkey\.key_length"),
])
def test_eval_script_refuses_bad_requests_with_the_fix(tmp_path, args, message):
    import eval_retrieval
    folder = tmp_path / "hf"
    tiny_model("llama", vocab_size=512, max_position_embeddings=4096).save_pretrained(folder)
    cfg = eval_retrieval.compose([f"target={folder}", "device=cpu"] + args)
    with pytest.raises((ConfigError, DataError), match=message):
        eval_retrieval.resolve(cfg, 1)


def test_eval_script_applies_memory_auto_as_training_does(tmp_path, monkeypatch):
    """memory=auto means the same to the scorer as to training (engine/run/startup.py): every preset predicted, the
    fastest that fits chosen, or a refusal. The scorer once ignored it and built with the defaults, saying nothing;
    a GPU of 0.0001 GiB fits no preset, so the refusal shows the choice is made."""
    import eval_retrieval
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(k, v)
    folder = tmp_path / "hf"
    tiny_model("llama", vocab_size=512, max_position_embeddings=4096).save_pretrained(folder)
    cfg = eval_retrieval.compose([f"target={folder}", "device=cpu", "parallelism.cp=1", "lengths=[256]",
                                  "memory=auto", "memory.auto_gpu_gib=0.0001"])
    with pytest.raises(ConfigError, match=r"memory=auto: no memory preset fits data.seq_len=256"):
        eval_retrieval.run(cfg)
    assert not (folder / "eval_retrieval").exists()  # refused before anything was written


def test_eval_script_in_fp8_scores_lengths_no_training_row_could_have(tmp_path):
    """Training refuses FP8 rows that are not multiples of 16 x cp (the weight gradient's GEMM); a scoring run has no
    backward, so a length of 1,000 is scored, and the plan's nominal length rounds up instead of being refused."""
    import eval_retrieval
    from configs.precision import check_fp8
    folder = tmp_path / "hf"
    tiny_model("llama", vocab_size=512, max_position_embeddings=4096).save_pretrained(folder)
    cfg = eval_retrieval.compose([f"target={folder}", "device=cuda", "precision=fp8", "parallelism.cp=2",
                                  "lengths=[200,1000]"])
    train_cfg, _, lengths, *_ = eval_retrieval.resolve(cfg, 2)
    assert lengths == [200, 1000] and train_cfg.data.seq_len == 1024
    check_fp8(train_cfg)  # the refusal a 1,000-token plan would meet
    with pytest.raises(ConfigError, match=r"data.seq_len=1000 over parallelism.cp=2"):
        check_fp8(dataclasses.replace(train_cfg, data=dataclasses.replace(train_cfg.data, seq_len=1000)))

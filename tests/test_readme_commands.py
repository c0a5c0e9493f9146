"""Every command in README.md's code blocks composes and validates as written, and the CPU ones run to the end.

Each command line (its `\\` continuations joined) is taken apart as the shell and the launcher would: leading
`VAR=value` assignments, `python` / `torchrun --nproc_per_node N` / `deepspeed --num_gpus N` (the world size),
`for s in a b; do ... $s ...; done` (one command per value), `a && b` (each part), and `<placeholder>`s filled
with a dummy. Then, as the script itself would:
- scripts/train.py: check_overrides, compose_config and validate at the launcher's world size;
- scripts/plan.py: the same at plan.gpus (default parallelism.cp), its plan.* keys checked;
- scripts/eval_retrieval.py: its own config composed, every key checked (the target is positional);
- any other script: that the file exists.

README: a line that needs GPUs ends in `# GPU` and is only parsed. Every other line is run here on CPU, except the
two set-up commands that CI runs anyway (the install with the demo, and the test suite), which are only parsed:
- the own-data line, on a 40-line train.jsonl written here, into a temporary run.out_dir (20 steps of the tiny
  model at cp=2 on 2 CPU ranks);
- the export line, on that run's checkpoint;
- the plan.py line (no model is built: its imports are most of its time).
The three took 108 s together on 2 cores that other jobs kept at a load of about 12, 44 s of CPU time
(2026-12-04): cheap enough to run rather than only compose.
docs/*.md and the experiments' header comments (hydra_conf/experiment/*.yaml): parse only. docs/benchmarks.md is
left out: its commands are the record of what ran then, with the flags of then. A `...` line (an excerpt of a
train.py command) is composed on the defaults at the demo's world size.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PARSED_DOCS = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md")
EXPERIMENTS = sorted((ROOT / "hydra_conf" / "experiment").glob("*.yaml"))
LAUNCHERS = ("python", "python3", "torchrun", "deepspeed", "bash", "pip")
CONFIGURED = ("train.py", "plan.py", "eval_retrieval.py")
DEMO_WORLD = 2  # the default config's cp: an excerpt (`...`) is composed at it
BIN = Path(sys.executable).parent  # the venv's, as `source .venv/bin/activate` puts it first on PATH


@dataclass
class Command:
    where: str  # file:line
    text: str
    gpu: bool = False
    env: dict = field(default_factory=dict)
    launcher: str = ""
    script: str = ""  # scripts/X.py, or "" for what is not a project script (venv, pip, pytest)
    args: list = field(default_factory=list)
    world: int = 1


def code_blocks(text: str):
    """(first line number, lines) of each code block: ``` fences, and 4-space indented blocks after a blank line."""
    lines = text.splitlines()
    i, prev_blank, blocks = 0, True, []
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            j = i + 1
            while j < len(lines) and not lines[j].lstrip().startswith("```"):
                j += 1
            blocks.append((i + 2, lines[i + 1:j]))
            i, prev_blank = j + 1, False
            continue
        if prev_blank and line.startswith("    ") and line.strip():
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            body = [x[4:] for x in lines[i:j]]
            while body and not body[-1].strip():
                body.pop()
            blocks.append((i + 1, body))
            i, prev_blank = j, False
            continue
        prev_blank = not line.strip()
        i += 1
    return blocks


def logical_lines(first: int, lines):
    """(line number, text) with `\\` continuations joined; comment-only and blank lines dropped."""
    out, buf, start = [], "", None
    for n, line in enumerate(lines, first):
        if start is None:
            start = n
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            buf += stripped[:-1].rstrip() + " "
            continue
        if re.search(r"(^|;\s*)do$", (buf + stripped.strip()).strip()):  # a for loop's body on the next lines
            buf += stripped.strip() + " "
            continue
        buf += stripped.strip()
        if buf.strip() and not buf.lstrip().startswith("#"):
            out.append((start, " ".join(buf.split())))
        buf, start = "", None
    return out


def _is_command(text: str) -> bool:
    words = text.split()
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words = words[1:]
    head = Path(words[0]).name if words else ""
    return bool(words) and (head in LAUNCHERS or words[0] in ("for", "...", "source"))


def split_command(where: str, text: str) -> list[Command]:
    """One Command per command the line runs."""
    gpu = bool(re.search(r"#\s*GPU\s*$", text))
    text = re.sub(r"\s+#.*$", "", text)
    loop = re.fullmatch(r"for (\w+) in ([^;]+); do (.+?)(?: \|\| break)?; done", text)
    if loop:
        var, values, body = loop.groups()
        return [c for v in values.split() for c in split_command(where, body.replace(f"${var}", v) + (" # GPU" if gpu else ""))]
    if " && " in text:
        return [c for part in text.split(" && ") for c in split_command(where, part + (" # GPU" if gpu else ""))]
    text = re.sub(r"<[^<>]*>", "PLACEHOLDER", text)  # <folder>, <run.out_dir>, <local folder of the checkpoint>
    text = re.sub(r"\s\[(-[^\]]*)\]", r" \1", text)  # an optional [--flag value]: given
    words = shlex.split(text)
    cmd = Command(where, text, gpu)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        key, _, value = words.pop(0).partition("=")
        cmd.env[key] = value
    cmd.launcher = words.pop(0)
    if cmd.launcher == "...":  # an excerpt of a train.py command
        cmd.script, cmd.args, cmd.world = "scripts/train.py", words, DEMO_WORLD
        return [cmd]
    name = Path(cmd.launcher).name
    if name in ("python", "python3") and words[:1] == ["-m"]:
        return [cmd]  # venv, pytest: not a project script
    if name == "torchrun":
        while words and words[0].startswith("--"):
            flag = words.pop(0)
            if flag.startswith("--nproc_per_node"):
                cmd.world = int(flag.partition("=")[2] or words.pop(0))
    elif name == "deepspeed":
        while words and words[0].startswith("--"):
            flag = words.pop(0)
            if flag.startswith("--num_gpus"):
                cmd.world = int(flag.partition("=")[2] or words.pop(0))
    elif name not in ("python", "python3", "bash"):
        return [cmd]  # pip, source
    cmd.script, cmd.args = words[0], words[1:]
    return [cmd]


def commands_of(path: Path, text: str | None = None) -> list[Command]:
    text = path.read_text() if text is None else text
    found = []
    for first, lines in code_blocks(text):
        for n, line in logical_lines(first, lines):
            if _is_command(line):
                found.extend(split_command(f"{path.relative_to(ROOT)}:{n}", line))
    return found


def _load_script(name: str):
    """A script's module, imported without running it (eval_retrieval.py rewrites sys.argv when imported)."""
    spec = importlib.util.spec_from_file_location(f"_readme_{Path(name).stem}", ROOT / "scripts" / name)
    module = importlib.util.module_from_spec(spec)
    argv = sys.argv
    sys.argv = [str(ROOT / "scripts" / name)]
    try:
        spec.loader.exec_module(module)
    finally:
        sys.argv = argv
    return module


def check_composes(cmd: Command) -> None:
    """What the script does with its command line before it builds anything; raises what it would refuse with. A
    `# GPU` line is checked as on the machine it is written for: device=auto resolves to CUDA there."""
    import torch
    from unittest import mock
    with mock.patch.object(torch.cuda, "is_available", lambda: cmd.gpu):
        _check_composes(cmd)


def _check_composes(cmd: Command) -> None:
    from configs import compose_config, validate
    from configs.compose import check_overrides
    script = Path(cmd.script).name
    assert (ROOT / cmd.script).is_file(), f"{cmd.where}: {cmd.script} does not exist"
    if script == "train.py":
        check_overrides(cmd.args)
        cfg = compose_config(cmd.args)
        path = str(cfg.model.path or "")
        if cfg.model.source == "pretrained" and re.fullmatch(r"outputs/[^/]+/hf_export", path) and \
                not Path(path).is_dir():  # a curriculum's earlier stage writes it; validate asks for a folder
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=tempfile.gettempdir()))
        validate(cfg, cmd.world)
    elif script == "plan.py":
        plan_keys = _load_script("plan.py").PLAN_KEYS
        plan = {a.partition("=")[0][5:]: a.partition("=")[2] for a in cmd.args if a.startswith("plan.")}
        assert set(plan) <= set(plan_keys), f"{cmd.where}: plan.py takes plan.{', plan.'.join(plan_keys)}"
        overrides = [a for a in cmd.args if not a.startswith("plan.")]
        check_overrides(overrides)
        cfg = compose_config(overrides)
        validate(cfg, int(plan.get("gpus", cfg.parallelism.cp)))
    elif script == "eval_retrieval.py":
        module = _load_script("eval_retrieval.py")
        args = [a if "=" in a or a.startswith("-") else f"target={a}" for a in cmd.args]
        check_overrides(args, module.RetrievalEvalConfig)
        cfg = module.compose(args)
        assert cmd.world % cfg.parallelism.cp == 0, f"{cmd.where}: parallelism.cp={cfg.parallelism.cp} on {cmd.world}"


def _parsed(paths):
    return [c for p in paths for c in commands_of(p) if c.script]


@pytest.mark.parametrize("cmd", _parsed([README] + PARSED_DOCS), ids=lambda c: c.where)
def test_each_documented_command_composes(cmd):
    check_composes(cmd)


def _experiment_commands() -> list[Command]:
    """The train.py lines in each experiment's header comment, and a `data ... add: <overrides>` suggestion
    composed onto the experiment itself, at the world size the file states."""
    found = []
    for path in EXPERIMENTS:
        header = []
        for line in path.read_text().splitlines():
            if not line.startswith("#"):
                break
            header.append(line[1:].strip())
        world = int(re.search(r"world_size:\s*(\d+)", "\n".join(header)).group(1))
        for n, text in logical_lines(1, header):
            where = f"{path.relative_to(ROOT)}:{n}"
            if "scripts/train.py" in text:
                words = text.split()
                start = next(i for i in range(len(words)) if _is_command(" ".join(words[i:])))
                found.extend(split_command(where, " ".join(words[start:])))
            elif "add:" in text and "=" in text:
                overrides = [w.replace("...", "PLACEHOLDER") for w in
                             re.sub(r"<[^<>]*>", "PLACEHOLDER", text.partition("add:")[2]).split() if "=" in w]
                found.append(Command(where, text, script="scripts/train.py", world=world,
                                     args=[f"experiment={path.stem}"] + overrides))
    return [c for c in found if c.script]


@pytest.mark.parametrize("cmd", _experiment_commands(), ids=lambda c: c.where)
def test_experiment_comments_compose(cmd):
    check_composes(cmd)


def test_the_parser_finds_the_commands():
    readme = commands_of(README)
    assert len(readme) >= 12 and sum(c.gpu for c in readme) >= 6, [c.where for c in readme]
    (loop,) = [c for c in commands_of(ROOT / "docs" / "retrieval.md") if "experiment=cpu_passkey_short" in c.args]
    assert loop.world == 2 and loop.env == {"OMP_NUM_THREADS": "1"}
    sample = "    deepspeed --num_gpus 4 --no_local_rank scripts/train.py a=1 \\\n        b=<x y>  # GPU\n"
    (cmd,) = commands_of(README, "text\n\n" + sample)
    assert (cmd.world, cmd.args, cmd.gpu) == (4, ["a=1", "b=PLACEHOLDER"], True)


def test_every_readme_block_line_is_a_command():
    """A README code block holds commands only, so none escapes the checks above."""
    for first, lines in code_blocks(README.read_text()):
        for n, line in logical_lines(first, lines):
            assert _is_command(line), f"README.md:{n} is not a command this test can check: {line}"


# the set-up commands CI runs on every push: the install (with the demo) and the test suite
def _ci_runs(cmd: Command) -> bool:
    return (Path(cmd.launcher).name in ("python3", "pip") and not cmd.script) or "pytest" in cmd.text or (
        cmd.script == "scripts/train.py" and not cmd.args)


def _runner(cmd: Command):
    script = Path(cmd.script).name
    if script == "train.py" and "data=jsonl" in cmd.args:
        return "own_data"
    if script in ("export_hf.py", "plan.py"):
        return script
    return None


def test_every_readme_cpu_command_is_run_here():
    """A README command without `# GPU` is one CI runs or one test_readme_cpu_commands_run runs."""
    cpu = [c for c in commands_of(README) if not c.gpu and not _ci_runs(c)]
    unrun = [c.where + ": " + c.text for c in cpu if _runner(c) is None]
    assert not unrun, "mark these `# GPU` or run them in this test:\n" + "\n".join(unrun)
    assert sorted(_runner(c) for c in cpu) == ["export_hf.py", "own_data", "plan.py"]


def _shell_argv(cmd: Command, replace: dict) -> list[str]:
    """The command as the shell would start it with the venv active, with some arguments replaced."""
    launcher = Path(cmd.launcher).name
    exe = str(BIN / ("python" if launcher.startswith("python") else launcher))
    args = [replace.get(a, a) for a in cmd.args]
    if launcher == "torchrun":
        return [exe, "--standalone", "--nproc_per_node", str(cmd.world), cmd.script] + args
    return [exe, cmd.script] + args


def _start(argv, env):
    return subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _finish(proc, timeout, want_stderr=False):
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    argv = proc.args
    assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    return (stdout, stderr) if want_stderr else stdout


def _run(argv, env, timeout):
    return _finish(_start(argv, env), timeout)


def test_readme_cpu_commands_run(tmp_path):
    """The own-data line on a small train.jsonl, the export of its checkpoint, and the plan.py line, as written.

    plan.py depends on neither of the others: it starts first and runs beside them (about 7 s, most of it imports,
    that would otherwise come after the export's); its output is checked at the end."""
    by_runner = {_runner(c): c for c in commands_of(README) if not c.gpu and not _ci_runs(c)}
    own, export, plan = by_runner["own_data"], by_runner["export_hf.py"], by_runner["plan.py"]
    planning = _start(_shell_argv(plan, {}), plan.env)
    try:
        corpus = [json.loads(line)["text"]
                  for line in (ROOT / "engine/demo_data/corpus.jsonl").read_text().splitlines()]
        data = tmp_path / "train.jsonl"
        data.write_text("".join(json.dumps({"text": corpus[i % len(corpus)]}) + "\n" for i in range(40)))
        out_dir = tmp_path / "own_data"
        path_arg = next(a for a in own.args if a.startswith("data.path="))
        argv = _shell_argv(own, {path_arg: f"data.path={data}"}) + [f"run.out_dir={out_dir}"]
        _, log = _finish(_start(argv, own.env), timeout=300, want_stderr=True)
        # a bf16 run: torchao, which transformers imports wherever it is installed, stays quiet (its import warns
        # "Failed to load" about CUDA-only extensions on CPU, which reads as our failure to a newcomer)
        assert "torchao" not in log, [line for line in log.splitlines() if "torchao" in line]
        metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
        assert any(m.get("step") == 20 for m in metrics), metrics[-1]
        tag = os.readlink(out_dir / "checkpoints" / "latest") if (out_dir / "checkpoints" / "latest").is_symlink() \
            else (out_dir / "checkpoints" / "latest").read_text().strip()
        tag = Path(tag).name
        run_arg = export.args[0]
        tag_value = export.args[export.args.index("--tag") + 1]
        printed = _run(_shell_argv(export, {run_arg: str(out_dir), tag_value: tag}), export.env, timeout=300)
        assert (Path(printed.strip().splitlines()[-1]) / "config.json").is_file(), printed
    except BaseException:  # the test fails before reading plan.py's output: stop it, not leave it running
        planning.kill()
        planning.communicate()
        raise
    table = _finish(planning, timeout=300)
    assert "<- chosen" in table and "no: host" not in table, table

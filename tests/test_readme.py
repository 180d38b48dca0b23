"""The code of the README and of every docs page runs as written.

The pages are README.md and every Markdown file under docs/ (the site's pages). Every
```python block runs in a directory of its own, as a file. A block whose first line
reads ``# NAME.py: run with  COMMAND`` is saved as NAME.py and started with COMMAND (under
``distcomm-run``, ``mpiexec`` or ``python``); any other block runs as ``python block.py``.
A block that imports CuPy runs only where CuPy has a device (and fails instead of skipping
when DISTCOMM_TEST_REQUIRE_GPU=1). Each must exit 0 and leave no process or shared-memory
file behind.

The shell blocks (plain ``` fences; ```text marks output) name hosts, clusters and GPUs
this machine may not have, so each of their commands is checked instead: a `distcomm-run`
line parses with the launcher's own parser and describes a valid configuration, every
``python -m MODULE`` names an importable module and every ``python FILE`` a file of the
repository (or one a Python block of a page defines), every ``--flag`` given to one of this
repository's programs is one of its flags, and every ``pip install`` extra exists. The
commands that can run on one host run for real (`RUN_HERE`), and `.ci/run` runs the
install, main-job and test lines exactly as the README gives them.
"""

from __future__ import annotations

import configparser
import functools
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from distcomm import run as launcher_cli
from distcomm.launch.run import config_from_args as agent_config
from tests import mpijobs

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
#: the pages whose blocks run: the README, then the docs pages in path order
PAGES = [README, *sorted((REPO / "docs").rglob("*.md"))]
TUTORIAL = REPO / "docs" / "tutorial.md"
CI = REPO / ".ci" / "run"

#: how a block says what starts it: "# first.py: run with  distcomm-run ... first.py"
HEADER = re.compile(r"#\s*(?P<file>[\w.-]+\.py):\s*run with\s+(?P<command>.+?)\s*$")
#: placeholders the pages' multi-host commands use, and what stands in for them here
PLACEHOLDERS = {
    "HOST": "127.0.0.1",
    "ETCD_HOST": "127.0.0.1",
    "$head": "127.0.0.1",
    "$SLURM_JOB_ID": "1",
    "N": "2",
}
#: shell commands of the pages that one host can run, run for real (each must be in one)
RUN_HERE = [
    "distcomm-run --standalone --nproc_per_node=4 -m distcomm.examples.quickstart --steps 300",
    "mpiexec -n 4 python -m distcomm.examples.quickstart --backend mpi",
    "HYDRA_IFACE=lo UCX_NET_DEVICES=lo mpiexec -n 4 python -m distcomm.examples.quickstart",
]
#: programs that wrap the command to check: their options come before it
WRAPPERS = {"srun", "mpiexec", "mpirun", "exec", "sh", "unshare"}
TIMEOUT = 240.0


@dataclass(frozen=True)
class Block:
    page: str  # the file, relative to the repository: "README.md", "docs/tutorial.md"
    line: int  # of the opening fence, 1-based
    info: str  # the fence's language ("" for shell commands)
    text: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def read_blocks(path: Path) -> list[Block]:
    page = str(path.relative_to(REPO))
    found, opened, info, lines = [], None, "", []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.startswith("```"):
            if opened is not None:
                lines.append(line)
            continue
        if opened is None:
            opened, info, lines = number, line[3:].strip(), []
        else:
            found.append(Block(page, opened, info, "\n".join(lines) + "\n"))
            opened = None
    assert opened is None, f"{page}:{opened}: a code fence is never closed"
    return found


BLOCKS = [block for page in PAGES for block in read_blocks(page)]
PYTHON = [b for b in BLOCKS if b.info == "python"]
SHELL = [b for b in BLOCKS if b.info in ("", "sh", "bash")]
README_SHELL = [b for b in SHELL if b.page == "README.md"]


def test_the_pages_have_only_known_kinds_of_block():
    kinds = {b.info for b in BLOCKS}
    assert kinds <= {"", "sh", "bash", "python", "text"}, kinds


def test_the_first_example_uses_the_launcher():
    first = next(b for b in PYTHON if b.page == str(TUTORIAL.relative_to(REPO)))
    header = HEADER.match(first.text.splitlines()[0])
    assert header and header["command"].startswith("distcomm-run "), first.text
    assert "init_process_group()" in first.text, first.text


# -- Python blocks ------------------------------------------------------------------------------


def _program(argv: list[str]) -> list[str]:
    """`argv` as this test runs it: python is this interpreter, distcomm-run its module,
    `mpiexec -n N` the MPI under test (the test skips without one)."""
    if argv[0] in ("mpiexec", "mpirun"):
        if mpijobs.LAUNCHER is None:
            pytest.skip(mpijobs.SKIP_REASON)
        assert argv[1] == "-n", f"write the rank count as `-n N`: {' '.join(argv)}"
        return mpijobs.LAUNCHER.command(int(argv[2]), *_program(argv[3:]))
    if argv[0] in ("python", "python3"):
        return [sys.executable, *argv[1:]]
    if argv[0] == "distcomm-run":
        return [sys.executable, "-m", "distcomm.run", *argv[1:]]
    return argv


def _command_of(block: Block, where: Path) -> list[str]:
    header = HEADER.match(block.text.splitlines()[0])
    name = header["file"] if header else "block.py"
    (where / name).write_text(block.text)
    if header is None:
        return [sys.executable, name]
    argv = shlex.split(header["command"])
    assert name in argv, f"{block.id}: the header's command does not run {name}"
    return _program(argv)


def _needs_a_gpu(block: Block) -> None:
    if not re.search(r"^import cupy|^from cupy", block.text, re.M):
        return
    from distcomm.gpu import device_count

    if device_count() > 0:
        return
    reason = f"{block.id} needs CuPy and a GPU"
    if os.environ.get("DISTCOMM_TEST_REQUIRE_GPU") == "1":
        pytest.fail(f"DISTCOMM_TEST_REQUIRE_GPU=1 but {reason}")
    pytest.skip(reason)


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.id)
def test_python_block_runs_as_written(block, tmp_path):
    _needs_a_gpu(block)
    command = _command_of(block, tmp_path)
    env = mpijobs.job_env(TMPDIR=str(tmp_path))
    done = mpijobs.run(command, timeout=TIMEOUT, cwd=tmp_path, env=env, merge_output=True)
    assert done.returncode == 0, f"{block.id} exited {done.returncode}:\n{done.stdout}"


# -- shell blocks ---------------------------------------------------------------------------------


def _lines(block: Block) -> list[str]:
    """The block's command lines: continuations joined, comments and blank lines dropped."""
    joined, current = [], ""
    for line in block.text.splitlines():
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        if current.strip() and not current.lstrip().startswith("#"):
            joined.append(current.strip())
        current = ""
    return joined


def _commands(line: str) -> list[list[str]]:
    """The simple commands of a line (split at && ; |), each without its VAR=value prefix,
    a wrapper's own `sh -c 'LINE'` expanded into LINE's commands."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars="&;|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    found, current = [], []
    for token in lexer:
        if token in ("&&", ";", "|", "||", "&"):
            found.append(current)
            current = []
        else:
            current.append(token)
    found.append(current)
    commands = []
    for argv in found:
        while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):
            argv = argv[1:]
        if argv[:1] == ["unshare"] and "-c" in argv:
            commands += _commands(argv[argv.index("-c") + 1])
        elif argv:
            commands.append(argv)
    return commands


def _program_argv(argv: list[str]) -> list[str] | None:
    """From a command, the part that runs one of ours (python/distcomm-run/pytest/pip),
    past the options of srun, mpiexec or exec before it; None when it runs none."""
    ours = ("python", "python3", "distcomm-run", "pytest", "pip")
    for at, token in enumerate(argv):
        if os.path.basename(token) in ours:
            return [os.path.basename(token), *argv[at + 1 :]]
        if at == 0 and token not in WRAPPERS:
            return None
    return None


def _substituted(argv: list[str]) -> list[str]:
    out = []
    for token in argv:
        for name, value in PLACEHOLDERS.items():
            token = re.sub(rf"(?<![\w$]){re.escape(name)}(?!\w)", value, token)
        out.append(token)
    return out


@functools.cache
def _flags_of(program: tuple[str, ...]) -> frozenset[str]:
    """The option strings `program --help` lists."""
    done = subprocess.run(
        [sys.executable, *program, "--help"],
        cwd=REPO,
        env=mpijobs.job_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"{' '.join(program)} --help failed:\n{done.stderr}"
    return frozenset(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", done.stdout))


def _check_flags(program: tuple[str, ...], args: list[str], where: str) -> None:
    known = _flags_of(program)
    for arg in args:
        if arg.startswith("-") and not re.fullmatch(r"-\d.*", arg):
            flag = arg.split("=", 1)[0]
            assert flag in known, f"{where}: {' '.join(program)} has no flag {flag}"


def _defined_files() -> set[str]:
    """The file names the pages' Python blocks declare (first.py, worker.py, ...)."""
    names = set()
    for block in PYTHON:
        header = HEADER.match(block.text.splitlines()[0])
        if header:
            names.add(header["file"])
    return names


def _check_python(args: list[str], where: str) -> None:
    if args[:1] == ["-m"]:
        module = args[1]
        if module in ("venv", "pytest", "pip"):
            return
        if importlib.util.find_spec(module) is None:
            # a tool that an extra installs (`python -m mkdocs` after `.[docs]`) need not be
            # installed where the tests run; it must be one of the extras' requirements
            assert module.split(".")[0] in _extra_requirements(), (
                f"{where}: no module {module}, and no extra of setup.cfg installs it"
            )
            return
        if module.startswith(("distcomm.", "benchmarks.")):
            _check_flags(("-m", module), args[2:], where)
        return
    script = args[0]
    if script in _defined_files():
        return
    assert (REPO / script).is_file(), f"{where}: no file {script} in the repository"
    _check_flags((script,), args[1:], where)


def _check_launcher(args: list[str], where: str) -> None:
    try:
        parsed = launcher_cli.parse_args(args)
        # what distcomm-run itself checks (torch's LaunchConfig cannot carry every flag:
        # --on-failure=replace is distcomm-run's alone)
        agent_config(parsed)
    except SystemExit:
        pytest.fail(f"{where}: distcomm-run does not accept {' '.join(args)}")
    except ValueError as exc:
        pytest.fail(f"{where}: distcomm-run {' '.join(args)}: {exc}")
    target = [parsed.training_script, *parsed.training_script_args]
    _check_python(["-m", *target] if parsed.module else target, where)


def _extras() -> dict[str, str]:
    """setup.cfg's extras: name -> its requirements, one per line."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return dict(cfg["options.extras_require"])


def _extra_requirements() -> set[str]:
    """The names of the packages setup.cfg's extras install (`mkdocs`, `mpi4py`, ...)."""
    names = set()
    for requirements in _extras().values():
        for line in requirements.split():
            found = re.match(r"[A-Za-z0-9_.-]+", line)
            if found:
                names.add(found[0].lower().replace("-", "_"))
    return names


def _check_pip(args: list[str], where: str) -> None:
    extras = set(_extras())
    for arg in args:
        found = re.fullmatch(r"\.\[([\w,-]+)\]", arg)
        if found:
            missing = set(found[1].split(",")) - extras
            assert not missing, f"{where}: setup.cfg has no extra {missing}"


def _checked(block: Block) -> int:
    count = 0
    for line in _lines(block):
        for argv in _commands(line):
            if argv[0] in ("sh", "bash") and argv[1:2] and argv[1].endswith(".sh"):
                assert (REPO / argv[1]).is_file(), f"{block.id}: no file {argv[1]}"
                count += 1
                continue
            ours = _program_argv(_substituted(argv))
            if ours is None:
                continue
            where = f"{block.id}: {line}"
            name, args = ours[0], ours[1:]
            if name == "distcomm-run":
                _check_launcher(args, where)
            elif name in ("python", "python3"):
                _check_python(args, where)
            elif name == "pip":
                _check_pip(args, where)
            elif name == "pytest":
                for arg in args:
                    if not arg.startswith("-"):
                        path = arg.split("::")[0]
                        assert (REPO / path).exists(), f"{where}: no {path}"
            count += 1
    return count


@pytest.mark.parametrize("block", SHELL, ids=lambda b: b.id)
def test_shell_block_names_real_programs_and_flags(block):
    assert _checked(block) > 0, f"{block.id} runs none of this repository's programs"


def test_ci_runs_the_readme_install_main_job_and_tests():
    install, tests = README_SHELL[0], README_SHELL[1]
    ci = CI.read_text()
    setup, _, job = install.text.strip().partition(" && ")
    for line in (setup, job, tests.text.strip()):
        assert re.search(rf"^{re.escape(line)}$", ci, re.M), f".ci/run does not run `{line}`"


@pytest.mark.parametrize("line", RUN_HERE)
def test_shell_command_runs_here(line, tmp_path):
    assert any(line in _lines(b) for b in SHELL), f"no page has `{line}` any more"
    env = mpijobs.job_env(TMPDIR=str(tmp_path))
    argv = shlex.split(line)
    while "=" in argv[0]:
        name, _, value = argv.pop(0).partition("=")
        env[name] = value
    if "HYDRA_IFACE" in line and mpijobs.LAUNCHER and mpijobs.LAUNCHER.kind != "mpich":
        pytest.skip(f"an MPICH command; the MPI under test is {mpijobs.LAUNCHER.name}")
    done = mpijobs.run(_program(argv), timeout=TIMEOUT, cwd=tmp_path, env=env, merge_output=True)
    assert done.returncode == 0, f"`{line}` exited {done.returncode}:\n{done.stdout}"
    assert "OK" in done.stdout, done.stdout


def test_the_first_mpiexec_example_says_how_to_keep_a_job_on_loopback():
    # MPICH picks a network interface by itself; a first run on a laptop or in a container
    # needs the hint where the first mpiexec command is, not hundreds of lines later: the
    # first a reader meets is in the backends page's mpi section
    lines = (REPO / "docs" / "backends.md").read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if re.match(r"(mpiexec|mpirun) ", line))
    nearby = "\n".join(lines[first : first + 15])
    assert "HYDRA_IFACE=lo UCX_NET_DEVICES=lo" in nearby, nearby


def test_the_docs_say_how_to_write_the_loop_without_ddp_or_a_sampler():
    text = TUTORIAL.read_text()
    section = re.split(
        r"^(#+) Data parallelism without DDP or DistributedSampler$", text, maxsplit=1, flags=re.M
    )
    assert len(section) == 3, "the tutorial lacks the section on data parallelism without DDP"
    level, body, fenced = len(section[1]), [], False
    for line in section[2].splitlines():  # up to the next heading of its level or above
        fenced ^= line.startswith("```")
        if not fenced and re.match(rf"#{{1,{level}}} ", line):
            break
        body.append(line)
    body = "\n".join(body)
    block = next(b for b in PYTHON if b.text in body)
    for call in ("dist.broadcast(", "dist.all_reduce(", "ReduceOp.AVG", "permutation("):
        assert call in block.text, call


def test_every_public_module_has_a_reference_entry():
    """The API reference (docs/reference/, rendered by mkdocstrings) covers every module of
    the public-modules table; `distcomm` itself through the hook's marker."""
    table = re.search(
        r"<!-- public-modules -->\n(.*?)\n<!-- /public-modules -->",
        (REPO / "docs" / "api.md").read_text(),
        re.S,
    )
    assert table, "docs/api.md lacks the <!-- public-modules --> section"
    listed = re.findall(r"^\| `([a-z_.]+)` \|", table.group(1), re.M)
    text = "\n".join(p.read_text() for p in sorted((REPO / "docs" / "reference").glob("*.md")))
    covered = set(re.findall(r"^::: ([\w.]+)$", text, re.M))
    if "<!-- reference: distcomm -->" in text:
        covered.add("distcomm")
    assert not set(listed) - covered, sorted(set(listed) - covered)


#: how many lines a newcomer reads before deciding: one screen
FIRST_SCREEN = 60


def test_the_readme_first_screen_says_what_it_is_how_to_run_it_and_shows_code():
    """The README's first screen: what distcomm is for, the install-and-run command, the
    test command and a short example that runs (as every Python block of the pages does,
    in `test_python_block_runs`); not a list of terms or the GPU stand-in's details."""
    first = [b for b in BLOCKS if b.page == "README.md" and b.line <= FIRST_SCREEN]
    assert README_SHELL[0] in first and README_SHELL[1] in first, (
        f"the install and test commands are not in the README's first {FIRST_SCREEN} lines"
    )
    examples = [b for b in first if b.info == "python"]
    assert examples and len(examples[0].text.strip().splitlines()) <= 15, (
        f"no short example in the README's first {FIRST_SCREEN} lines"
    )
    opening = README.read_text().split("\n## ", 1)[0]
    assert "torch.distributed" in opening and "numpy" in opening, opening
    assert "stand-in" not in "\n".join(README.read_text().splitlines()[:FIRST_SCREEN])


def test_no_page_guesses_the_size_of_the_suite():
    """ "About 6,000 tests" goes stale with the next test; `pytest --collect-only` counts
    them. (A record of what ran, "164 tests" on a GPU, is a fact, not a guess.)"""
    for page in PAGES:
        found = re.search(r"\b(?:about|over|some|nearly|almost) \d[\d,]* tests\b", page.read_text())
        assert found is None, f"{page.name}: {found.group(0)!r}"

"""The documentation: the README and the site in docs/ (MkDocs, mkdocs.yml). The site builds with ``--strict``,
every link resolves, and every code block runs as written, page by page in a fresh directory:

- ``python`` blocks are executed; ``console`` blocks run each command (``dllm ...`` in this process, anything with
  a pipe, a variable or another program through bash), and a ``dllm generate $'...'   # TEXT`` line must print
  TEXT (``/`` for a line break) without a warning; ``dllm serve`` starts a server for the page's later blocks
  (their ``127.0.0.1:8000`` is its port) and must stop cleanly on Ctrl-C; a ``yaml`` block whose first line is
  ``# NAME`` is written to the file NAME; a ``toml`` block (a package's entry points) must name dllm's plugin
  groups; ``text`` is output, not code; ``bash`` is the README's set-up only (``.ci/run`` runs it).
- Hub ids in commands resolve to tiny random checkpoints of the same family in an offline Hugging Face cache, so
  a real checkpoint's example runs its real loading path, offline.
"""

from __future__ import annotations

import codecs
import dataclasses
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import requests

from dllm.cli import main
from dllm.core import plugins
from dllm.models.tiny import make_tiny_checkpoint

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = {"bash", "console", "python", "yaml", "toml", "text"}
# the checkpoints the examples name, as tiny random ones of their family (hub id -> family)
HUB = {
    "GSAI-ML/LLaDA-8B-Instruct": "llada",
    "GSAI-ML/LLaDA-8B-Base": "llada",
    "Dream-org/Dream-v0-Instruct-7B": "dream",
    "google/diffusiongemma-26B-A4B-it": "diffusion_gemma",
}
# the guides' examples stay short: each seam in under 40 lines, a family or a process in under 60
LONGEST = {"writing-samplers.md": 40, "extending.md": 59}


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int
    language: str
    code: str


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [
        Block(page, text[: m.start()].count("\n") + 1, m[1], m[2])
        for m in re.finditer(r"^```(\S*)\n(.*?)^```$", text, flags=re.S | re.M)
    ]


ALL = [b for page in PAGES for b in blocks(page)]


def test_the_site_builds_strictly_with_every_page_in_its_navigation(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    built = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("index.html")}
    for page in PAGES[1:]:
        name = "index.html" if page.stem == "index" else f"{page.stem}/index.html"
        assert name in built, page.name


def test_every_link_resolves():
    """Links into the repository outside docs/ (eval/results) are not pages of the site, so mkdocs does not check
    them: this does, and the anchors of links to README sections."""
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            assert resolved.exists(), f"{page.name}: {target}"
            if anchor and resolved.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", resolved.read_text(), flags=re.M)
                slugs = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}
                assert anchor in slugs, f"{page.name}: {target}"


def test_every_block_says_what_it_is_and_only_the_readme_has_set_up_commands():
    for block in ALL:
        assert block.language in LANGUAGES, f"{block.page.name}:{block.line}: ```{block.language}"
        assert block.language != "bash" or block.page.name == "README.md", f"{block.page.name}:{block.line}"
    (set_up,) = [b for b in ALL if b.language == "bash"]
    assert set_up == blocks(ROOT / "README.md")[0] and len(set_up.code.splitlines()) == 2  # what .ci/run runs


def test_the_readme_is_short_and_starts_with_the_set_up():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert readme.index("## Set-up") < readme.index("```bash") == readme.index("```")


@pytest.mark.parametrize("name", sorted(LONGEST))
def test_the_guides_examples_stay_short(name):
    examples = [b for b in blocks(ROOT / "docs" / name) if b.language == "python"]
    assert examples and all(len(b.code.strip().splitlines()) <= LONGEST[name] for b in examples)


# -- running the blocks ------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def hub(tmp_path_factory):
    """An offline Hugging Face cache holding a tiny random checkpoint (with a chat template) under each hub id."""
    cache = tmp_path_factory.mktemp("hub")
    for seed, (repo, family) in enumerate(HUB.items()):
        commit = f"{seed:040x}"
        folder = cache / f"models--{repo.replace('/', '--')}"
        make_tiny_checkpoint(folder / "snapshots" / commit, family, seed=seed)
        (folder / "refs").mkdir()
        (folder / "refs" / "main").write_text(commit)
    return cache


def shell_words(line: str) -> list[str]:
    """The words bash makes of ``line`` for the commands the docs write (ANSI-C ``$'...'`` included)."""
    unquoted = re.sub(r"\$'((?:[^'\\]|\\.)*)'", lambda m: shlex.quote(codecs.decode(m[1], "unicode_escape")), line)
    return shlex.split(unquoted, comments=True)


def commands(code: str) -> list[str]:
    return [c for c in code.replace("\\\n", " ").splitlines() if c.strip() and not c.lstrip().startswith("#")]


def in_process(command: str) -> bool:
    return command.startswith("dllm ") and not re.search(r"[|;&<>$`]", command.replace("$'", ""))


class Page:
    """One page's blocks run in order in ``directory``: servers it starts serve its later blocks."""

    def __init__(self, directory: Path, hub: Path, capsys):
        self.directory, self.capsys, self.servers, self.port = directory, capsys, [], None
        self.env = {
            **os.environ,
            "HF_HUB_CACHE": str(hub),
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": str(ROOT),
        }

    def served(self, text: str) -> str:
        return text if self.port is None else text.replace("127.0.0.1:8000", f"127.0.0.1:{self.port}")

    def run(self, block: Block) -> None:
        where = f"{block.page.name}:{block.line}"
        if block.language == "python":
            exec(compile(self.served(block.code), where, "exec", dont_inherit=True), {"__name__": "docs_example"})
        elif block.language == "yaml" and block.code.startswith("# "):
            (self.directory / block.code.splitlines()[0][2:].strip()).write_text(block.code)
        elif block.language == "toml":
            for group, entries in re.findall(r'^\[project\.entry-points\."([^"]+)"\]\n((?:\w.*\n)+)', block.code, re.M):
                assert group in plugins.GROUPS, f"{where}: {group}"
                assert all(re.match(r'\w+ = "[\w.]+:\w+"', entry) for entry in entries.splitlines()), where
        elif block.language == "console":
            for command in commands(block.code):
                self.command(command, where)

    def command(self, command: str, where: str) -> None:
        expected = re.match(r"^dllm generate \$'.*?'.*?\s+# (.+)$", command)
        if command.startswith("dllm serve "):
            return self.serve(command, where)
        if not in_process(command):
            run = subprocess.run(
                ["bash", "-c", self.served(command)], cwd=self.directory, env=self.env, capture_output=True,
                text=True, timeout=600,
            )  # fmt: skip
            assert run.returncode == 0, f"{where}: {command}\n{run.stdout}\n{run.stderr}"
            return
        self.capsys.readouterr()
        try:
            status = main(shell_words(command)[1:])
        except SystemExit as e:  # --help, --version
            status = e.code
        out, err = self.capsys.readouterr()
        assert status == 0, f"{where}: {command}\n{err}"
        if expected:
            assert out.strip().replace("\n", " / ") == expected[1], f"{where}: {command}"
            assert "warning" not in err, f"{where}: {command}\n{err}"

    def serve(self, command: str, where: str) -> None:
        self.stop()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        process = subprocess.Popen(
            ["bash", "-c", f"exec {command.split('  #')[0]} --port {self.port}"], cwd=self.directory, env=self.env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.servers.append((process, where))
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None and time.monotonic() < deadline, f"{where}: {process.communicate()[0]}"
            try:
                requests.get(f"http://127.0.0.1:{self.port}/health", timeout=1)
                return
            except requests.ConnectionError:
                time.sleep(0.2)

    def stop(self) -> None:
        while self.servers:
            process, where = self.servers.pop()
            process.send_signal(signal.SIGINT)
            output, _ = process.communicate(timeout=60)
            assert process.returncode == 0 and "Traceback" not in output, f"{where}: {output}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_code_block_runs_as_written(page, hub, tmp_path, capsys, monkeypatch, registries, lm_eval_state):
    import huggingface_hub

    model = r"(?:--model |pretrained=|dllm serve |dllm\.load\(\")([^\s,\")]+)"
    named = {m for b in blocks(page) for m in re.findall(model, b.code) if "/" in m}  # (lm-eval's --model dllm)
    assert named <= set(HUB), f"{page.name}: add {sorted(named - set(HUB))} to HUB"
    lookup = partial(huggingface_hub.snapshot_download, cache_dir=hub, local_files_only=True)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lookup)
    monkeypatch.chdir(tmp_path)
    runner = Page(tmp_path, hub, capsys)
    try:
        for block in sorted(blocks(page), key=lambda b: b.language != "yaml"):  # files first: commands read them
            runner.run(block)
    finally:
        runner.stop()


PROSE = [
    (page, m)
    for page in PAGES
    for m in re.findall(r"`dllm generate\s+(\$'.*?'[^`]*)` prints `([^`]*)` at NFE (\d+)", page.read_text(), re.S)
]


@pytest.mark.parametrize("page,claim", PROSE, ids=lambda x: x.name if isinstance(x, Path) else x[1])
def test_a_command_in_the_prose_prints_what_it_says(page, claim, capsys):
    """The EOS early-stop sentence: its command once printed a wrong answer (`7 7 14` at two tokens per step)."""
    command, expected, nfe = claim
    assert main(["generate", *shell_words(" ".join(command.split()))]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == expected and f"] NFE {nfe} |" in err

"""The README and docs/ stay true: the configuration page lists every setting and the pages name no other;
every `module:function`, repository path and relative link they name exists; their command lines parse
(the offline ones run) and their Python examples import what exists."""
from __future__ import annotations

import ast
import importlib
import re
import shlex
from pathlib import Path

import pytest

from loramux.cli import build_parser, main
from loramux.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PAGE_IDS = [page.relative_to(ROOT).as_posix() for page in PAGES]
# LORAMUX_* names in the pages that are no setting: the shell variable of the examples, the test suite's own.
NOT_SETTINGS = {"LORAMUX_", "LORAMUX_KEY", "LORAMUX_TEST_POSTGRES_URL", "LORAMUX_TEST_REDIS_URL"}
REFERENCE = re.compile(r"`(loramux(?:\.\w+)+):([\w.]+)`")
REPO_PATH = re.compile(r"(?<![\w/.-])((?:platform|adapters|kernels|admin|migrations|tests|bench|docs)/[\w/.-]*\w)")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def settings() -> set[str]:
    return {f"LORAMUX_{name.upper()}" for name in Settings.model_fields}


def section(page: Path, title: str) -> str:
    text = page.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.M | re.S)


def resolve(module_name: str, qualname: str):
    target = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    return target


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_configuration_page_documents_every_setting():
    documented = set(re.findall(r"^\| `(LORAMUX_[A-Z0-9_]+)`|, `(LORAMUX_[A-Z0-9_]+)`",
                                (ROOT / "docs" / "configuration.md").read_text(), re.M))
    documented = {name for pair in documented for name in pair if name}
    missing = sorted(settings() - documented)
    assert missing == [], f"add these to the table in docs/configuration.md: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_pages_name_only_real_settings(page):
    named = set(re.findall(r"LORAMUX_[A-Z0-9_]*", page.read_text()))
    assert sorted(named - settings() - NOT_SETTINGS) == [], "no such setting (renamed or removed?)"


@pytest.mark.parametrize("title", ["Life of a request", "Life of an adapter"])
def test_life_sections_map_many_functions(title):
    assert len(REFERENCE.findall(section(ROOT / "docs" / "architecture.md", title))) >= 10


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_named_functions_exist(page):
    missing = [f"{module}:{name}" for module, name in REFERENCE.findall(page.read_text())
               if resolve(module, name) is None]
    assert missing == [], f"{page.name} names functions that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_named_repository_paths_exist(page):
    missing = sorted({path for path in REPO_PATH.findall(page.read_text()) if not (ROOT / path).exists()})
    assert missing == [], f"{page.name} names paths that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_relative_links_and_their_anchors_exist(page):
    broken = []
    for link in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(link)
        elif anchor and target.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            if anchor not in {github_anchor(h) for h in headings}:
                broken.append(link)
    assert broken == [], f"{page.name} has broken links: {broken}"


def readme_diagram() -> str:
    (diagram,) = code_blocks((ROOT / "README.md").read_text(), "mermaid")
    return diagram


def test_readme_diagram_names_real_folders_and_packages():
    diagram = readme_diagram()
    folders = re.findall(r"\b((?:platform|admin)/\w+)", diagram)
    assert folders and all((ROOT / folder).is_dir() for folder in folders), folders
    for package in re.findall(r"\b(loramux(?:\.\w+)+)", diagram):
        importlib.import_module(package)


def command_lines(text: str) -> list[list[str]]:
    """The `loramux` commands of the page's bash blocks, as argv lists (continuations joined, comments and
    leading VAR=value assignments dropped)."""
    commands = []
    for block in code_blocks(text, "bash"):
        aliases = dict(re.findall(r"^(\w+)=(\S+)$", block, re.M))
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and re.match(r"^\w+=", words[0]):
                words.pop(0)
            if words and words[0].startswith("$") and words[0][1:] in aliases:
                words[0] = aliases[words[0][1:]]
            if words and Path(words[0]).name == "loramux":
                commands.append(words[1:])
    return commands


ALL_COMMANDS = [(page, argv) for page in PAGES for argv in command_lines(page.read_text())]


def test_pages_show_commands():
    assert len(ALL_COMMANDS) >= 15, ALL_COMMANDS


@pytest.mark.parametrize("page,argv", ALL_COMMANDS,
                         ids=[f"{page.name}:{' '.join(argv[:3])}" for page, argv in ALL_COMMANDS])
def test_command_examples_parse(page, argv):
    build_parser().parse_args(argv)  # argparse exits on an unknown command or option


@pytest.mark.parametrize("argv", [argv for _, argv in ALL_COMMANDS if argv[0] == "plan"])
def test_plan_examples_run(argv, capsys):
    assert main(argv) == 0
    assert "fits" in capsys.readouterr().out


PYTHON_EXAMPLES = [(page, block) for page in PAGES for block in code_blocks(page.read_text(), "python")]


@pytest.mark.parametrize("page,block", PYTHON_EXAMPLES, ids=[page.name for page, _ in PYTHON_EXAMPLES])
def test_python_examples_import_what_exists(page, block):
    tree = ast.parse(block)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module.startswith("loramux"):
            for alias in node.names:
                assert resolve(node.module, alias.name) is not None, f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
